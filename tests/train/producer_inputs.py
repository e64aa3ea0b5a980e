"""Test helper: what the ``train --producer vllm`` tests train on (16 chats prepared for SmolLM2, token ids only, and a
512-token draft vocabulary), and an address nobody listens at."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from train_inputs import make_chats

from tiny_speculators.serving import free_port

N_CHATS = 16


@dataclass
class ProducerInputs:
    prepared: Path
    vocab: Path


def producer_inputs(root: Path) -> ProducerInputs:
    from tiny_speculators.data.prepare import prepare
    from tiny_speculators.data.vocab import vocab

    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps(c) + "\n" for c in make_chats(N_CHATS)), encoding="utf-8")
    prepare(verifier="smollm2-135m", data=[chats], out=root / "prepared", max_length=96)
    vocab(data=root / "prepared", out=root / "vocab", size=512)
    return ProducerInputs(root / "prepared", root / "vocab")


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nobody listens there: connections are refused
