"""Tiny training inputs built through the real stages: chats -> prepare -> vocab -> extract.

A module of its own, not ``conftest``: test files import these helpers by name, and pytest loads several
``conftest`` modules (tests/verifier has one too), so ``from conftest import ...`` found whichever came first.

    from train_inputs import build_inputs, make_chats
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TOPICS = ["the ocean", "a small garden", "trains", "the moon", "bread", "rain", "a library", "mountains",
          "coffee", "a river", "winter", "music", "bicycles", "clocks", "bees", "paper"]


def make_chats(n: int, long: bool = False) -> list[dict]:
    chats = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        a, b = i % 7 + 2, i % 5 + 3
        answer = (f"Here are a few facts about {topic}. First, {topic} can be found in many places. "
                  f"Second, people often write stories about {topic}. Also, {a} + {b} = {a + b}.")
        if long:
            answer += (f" Many people like {topic} because it is calm and simple. When you think about {topic}, "
                       f"you might remember a day from your childhood. That is all about {topic}.")
        chats.append({"messages": [{"role": "user", "content": f"Tell me about {topic}, and add {a} and {b}."},
                                   {"role": "assistant", "content": answer}]})
    return chats


@dataclass
class TrainInputs:
    verifier: Path
    prepared: Path
    vocab: Path
    hidden_states: Path


def build_inputs(root: Path, verifier: Path, n_chats: int, vocab_size: int, max_length: int,
                 long: bool = False) -> TrainInputs:
    from tiny_speculators.data.prepare import prepare
    from tiny_speculators.data.vocab import vocab
    from tiny_speculators.verifier.extract import extract

    root.mkdir(parents=True, exist_ok=True)
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps(c) + "\n" for c in make_chats(n_chats, long)), encoding="utf-8")
    prepare(verifier=str(verifier), data=[chats], out=root / "prepared", max_length=max_length)
    vocab(data=root / "prepared", out=root / "vocab", size=vocab_size)
    extract(verifier=str(verifier), data=root / "prepared", out=root / "hs", dtype="float32", device="cpu",
            progress=False)
    return TrainInputs(verifier, root / "prepared", root / "vocab", root / "hs")
