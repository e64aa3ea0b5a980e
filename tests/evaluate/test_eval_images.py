"""Image chats end to end on tiny random Qwen2.5-VL and Qwen3-VL verifiers, as a user runs the stages: prepare ->
extract -> vocab -> train (EAGLE-3, offline) -> export -> evaluate on prompts with images. The evaluator's greedy
output is the verifier's own (``generate`` with the processor's inputs), the draft runs at the positions it was
trained at (the temporal row of the verifier's M-RoPE positions), and it learned its training chats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tiny_speculators import cli
from tiny_speculators.storage.reader import HiddenStateReader
from tiny_speculators.verifier.load import load_verifier
from tiny_speculators.verifier.vision import Vision
from tiny_vl import make_image


def _run(*args: str) -> None:
    assert cli.main([*args]) == 0, args


def _user(image: str) -> dict:
    return {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Describe it."}]}


def _greedy(model, processor, messages: list[dict], n: int) -> list[int]:
    """The verifier's own greedy answer (``generate`` on the processor's inputs)."""
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt", processor_kwargs={"return_mm_token_type_ids": True})
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module")
def image_run(tiny_vl_dir, tmp_path_factory) -> Path:
    """The stages on two image chats whose answers are the verifier's own greedy ones (self-distilled, as
    ``regenerate`` makes them), repeated, then exported."""
    run = tmp_path_factory.mktemp("image-run")
    make_image(run / "a.png", (84, 56), 5)
    make_image(run / "b.png", (56, 56), 6)
    model, tokenizer = load_verifier(tiny_vl_dir)
    processor = Vision.load(tiny_vl_dir).processor
    chats = [{"messages": [_user(name), {"role": "assistant", "content": tokenizer.decode(
        _greedy(model, processor, [_user(str(run / name))], 16), skip_special_tokens=True)}]}
        for name in ("a.png", "b.png")]
    (run / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats * 4))
    v = str(tiny_vl_dir)
    _run("prepare", "--verifier", v, "--data", str(run / "chats.jsonl"), "--out", str(run / "prepared"))
    _run("extract", "--data", str(run / "prepared"), "--out", str(run / "extract"), "--dtype", "float32",
         "--no-progress")
    _run("vocab", "--data", str(run / "prepared"), "--out", str(run / "vocab"), "--size", "256")
    _run("train", "--verifier", v, "--hidden-states", str(run / "extract"), "--vocab", str(run / "vocab"),
         "--out", str(run / "train"), "--max-steps", "60", "--batch-size", "4", "--lr", "3e-3",
         "--eval-fraction", "0", "--no-progress", "--save-every", "60")
    _run("export", str(run / "train" / "step_000060"), "--out", str(run / "export"))
    return run


def test_evaluate_decodes_image_prompts_as_the_verifier_does(image_run, tiny_vl_dir):
    run = image_run
    prompts = [{"id": "a", "messages": [{"role": "user", "content": [
                   {"type": "image_url", "image_url": {"url": (run / "a.png").as_uri()}},
                   {"type": "text", "text": "Describe it."}]}]},
               {"id": "b", "messages": [{"role": "user", "content": [{"type": "image", "image": "b.png"},
                                                                     {"type": "text", "text": "Describe it."}]}]},
               {"id": "text", "prompt": "Describe it."}]
    (run / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    _run("evaluate", "--verifier", str(tiny_vl_dir), "--draft", str(run / "export"), "--out", str(run / "eval"),
         "--prompts", str(run / "prompts.jsonl"), "--max-new-tokens", "12", "--k", "3")
    results = json.loads((run / "eval" / "results.json").read_text())
    assert results["matches_baseline"] is True
    # the verifier's own greedy answer, from transformers' generate on the processor's inputs
    model, _ = load_verifier(tiny_vl_dir)
    processor = Vision.load(tiny_vl_dir).processor
    for entry, name in zip(results["per_prompt"][:2], ("a.png", "b.png"), strict=True):
        assert entry["tokens"] == _greedy(model, processor, [_user(str(run / name))], 12)[:len(entry["tokens"])]
    # the draft learned what it was trained on, images before it (its positions skip as in training)
    image_tau = [e["acceptance_length"] for e in results["per_prompt"][:2]]
    assert min(image_tau) > 1.5, image_tau


def test_the_draft_runs_at_the_positions_it_was_trained_at(image_run, tiny_vl_dir):
    """Evaluation gives the draft the temporal row of the verifier's M-RoPE positions for a prompt with an image:
    the positions extraction stored for the same tokens (training read them)."""
    from tiny_speculators.evaluate.prompts import Prompt, render_image_prompt
    from tiny_speculators.evaluate.target import TargetRunner

    run = image_run
    vision = Vision.load(tiny_vl_dir)
    prompt = Prompt("a", [{"role": "user", "content": [{"type": "image", "image": "a.png"},
                                                       {"type": "text", "text": "Describe it."}]}], base=run)
    ids, images = render_image_prompt(prompt, vision)
    model, _ = load_verifier(tiny_vl_dir, with_tokenizer=False)
    target = TargetRunner(model, [2])
    rope = target.rope_positions(ids, images)
    stored = HiddenStateReader(run / "extract")[0]
    assert stored["input_ids"][:len(ids)].tolist() == ids
    assert rope[0].tolist() == stored["position_ids"][:len(ids)].tolist()
    assert rope[0, -1] < len(ids) - 1  # the image's tokens take fewer positions than slots


def test_trees_and_drafts_without_positions_refuse_image_prompts():
    """Only chain drafts that take the prompt's positions (EAGLE-3, MTP) decode prompts with images."""
    from tiny_speculators.errors import UserError
    from tiny_speculators.evaluate.decoding import TreeParams, speculative_generate
    from tiny_speculators.models.chain import ChainProposer

    images = {"position_ids": torch.zeros(3, 2, dtype=torch.long)}
    for proposer, tree in ((object(), None), (ChainProposer.__new__(ChainProposer), TreeParams())):
        with pytest.raises(UserError, match="a prompt with images is decoded with a chain draft that takes"):
            speculative_generate(None, proposer, [1, 2], images=images, tree=tree)
