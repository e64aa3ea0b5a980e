"""The verifiers users bring beyond dense Llama/Qwen3 (MoE, sliding window and attention sinks, MLA, a multimodal
wrapper's text path), each through the stages as a user runs them: HF extraction stores states that reproduce the
verifier's own hidden states and logits, an EAGLE-3 draft trains on them and exports, and our evaluator decodes
with it exactly the verifier's greedy output."""

from __future__ import annotations

import json

import pytest

from extract_checks import check_exact
from prepared_data import make_prepared
from tiny_architectures import ARCHITECTURES, make_tiny_architecture
from tiny_speculators.data.prepare import prepare
from tiny_speculators.data.vocab import vocab
from tiny_speculators.evaluate.stage import evaluate
from tiny_speculators.export.stage import export
from tiny_speculators.storage.reader import HiddenStateReader
from tiny_speculators.train.stage import train
from tiny_speculators.verifier.extract import extract
from tiny_speculators.verifier.load import load_verifier

SMALL = dict(shard_mb=0.05, max_tokens_per_batch=40, progress=False)  # several shards, padded batches
TOPICS = ["the sea", "bread", "trains", "the moon", "rain", "bees"]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def verifier(request, tmp_path_factory, smollm2_tokenizer):
    name = request.param
    return name, make_tiny_architecture(tmp_path_factory.mktemp(name), name, smollm2_tokenizer)


def test_hf_extraction_reproduces_the_verifier(verifier, tmp_path, smollm2_tokenizer):
    _, path = verifier
    vocab = len(smollm2_tokenizer)  # ids below the multimodal wrapper's image/boi/eoi ids (the last three)
    prepared = make_prepared(tmp_path / "prepared", str(path), vocab - 3, [3, 17, 30, 8, 25, 1], summary_vocab=vocab)
    summary = extract(data=prepared, out=tmp_path / "out", dtype="float32", device="cpu", **SMALL)
    assert summary["complete"] and summary["shards_total"] >= 2
    assert summary["guard_positions"] > 0 and summary["guard_agreed"] == summary["guard_positions"]
    reader = HiddenStateReader(tmp_path / "out")
    assert reader.manifest["aux_layer_ids"] == [2, 4, 5]
    check_exact(reader, load_verifier(path, with_tokenizer=False)[0], prepared, [2, 4, 5])


def prepared_chats(path, tmp_path):
    """A few chats through prepare and vocab for ``path``, in ``tmp_path`` (prepared/, vocab/)."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Tell me about {topic}."},
        {"role": "assistant", "content": f"Here is one fact about {topic}: people like {topic} a lot."}]}) + "\n"
        for topic in TOPICS), encoding="utf-8")
    prepare(verifier=str(path), data=[chats], out=tmp_path / "prepared", max_length=96)
    vocab(data=tmp_path / "prepared", out=tmp_path / "vocab", size=512)


def test_an_eagle3_draft_trains_online(verifier, tmp_path):
    """Online training: the verifier runs beside the draft and computes the states of each batch."""
    _, path = verifier
    prepared_chats(path, tmp_path)
    summary = train(verifier=str(path), vocab=tmp_path / "vocab", data=tmp_path / "prepared", online=True,
                    out=tmp_path / "run", max_steps=3, lr=1e-2, warmup_steps=0, eval_fraction=0.0, save_every=0,
                    progress=False, seed=0)
    assert (tmp_path / "run" / "final").is_dir()
    assert summary["steps"] == 3


def test_an_eagle3_draft_trains_exports_and_decodes_losslessly(verifier, tmp_path):
    _, path = verifier
    prepared_chats(path, tmp_path)
    extract(data=tmp_path / "prepared", out=tmp_path / "hs", dtype="float32", device="cpu", progress=False)
    train(verifier=str(path), vocab=tmp_path / "vocab", hidden_states=tmp_path / "hs", out=tmp_path / "run",
          max_steps=4, lr=1e-2, warmup_steps=0, eval_fraction=0.0, save_every=0, progress=False, seed=0)
    export(tmp_path / "run" / "final", out=tmp_path / "export", speculative_tokens=3)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    result = evaluate(str(path), tmp_path / "export", tmp_path / "eval", prompts="math", max_prompts=2,
                      max_new_tokens=12, k=3)
    assert result["matches_baseline"] is True  # lossless: the verifier's own greedy output
