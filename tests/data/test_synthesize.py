"""``synthesize``: the user-turn prefix of a real chat template, the filters one reason at a time, and the stage on a
tiny verifier in-process (counts add up, the same seed gives the same prompts, a kill resumes to them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiny_speculators.data.dedup import Contamination, NearDuplicates, looping
from tiny_speculators.data.synthesize import _evaluation_texts, _Filters, synthesize, user_turn_prefix
from tiny_speculators.errors import UserError

FAST = dict(backend="transformers", count=10, batch_size=4, max_prompt_tokens=6, min_words=0, device="cpu")


def test_the_prefix_is_the_template_up_to_the_users_words(smollm2_tokenizer):
    ids, end = user_turn_prefix(smollm2_tokenizer, None)
    text = smollm2_tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\n") and end == "<|im_end|>"
    ids, _ = user_turn_prefix(smollm2_tokenizer, "You write Python.")
    assert smollm2_tokenizer.decode(ids) == "<|im_start|>system\nYou write Python.<|im_end|>\n<|im_start|>user\n"


def test_near_duplicates_looping_and_contamination():
    seen = NearDuplicates(0.7)
    assert seen.add("Write a poem about the sea.") and not seen.add("write a poem, about the SEA!")
    assert not seen.add("Write a poem about the sea, please.")  # 4 of its 5 word 3-grams seen: Jaccard 0.8
    assert seen.add("Write me a poem about the sea.")  # 3 shared of 6 in all: 0.5
    assert seen.add("Explain how quicksort partitions an array.")
    assert looping("yes yes yes yes yes yes yes yes yes yes") and looping("the cat the cat the cat the cat")
    assert not looping("How do I reverse a linked list in place without extra memory?")
    held_out = Contamination(["How do I sort a list?", "Write a function that returns the nth Fibonacci number "
                                                        "using memoization in Python."])
    assert held_out.hits("how do I sort a list") and held_out.hits("Please write a function that returns the nth "
                                                                   "Fibonacci number using memoization")
    assert not held_out.hits("Sort my list of names.")


def test_each_filter_drops_for_its_reason():
    builtin = _evaluation_texts(None)
    assert len(builtin) >= 36  # the held-out chat, code and math prompts
    raw = [{"text": t, "tokens": 5, "truncated": cut} for t, cut in [
        ("", False), ("What is the capital", True), ("Hi", False), ("word " * 300, False),
        ("the cat the cat the cat the cat the cat", False), (builtin[0], False), ("Tell me about Rome.", False),
        ("tell me about rome", False), ("Give me three tips for sleeping better.", False), ("An example seed.", False)]]
    raw[8]["more"] = [{"answer": "Sure.", "answer_tokens": 2, "text": "And for waking up?", "tokens": 5,
                       "truncated": False},
                      {"answer": "Yes.", "answer_tokens": 2, "text": builtin[1], "tokens": 9, "truncated": False},
                      {"answer": "No.", "answer_tokens": 2, "text": "More?", "tokens": 2, "truncated": False}]
    filters = _Filters(min_words=3, max_words=200, near_duplicate=0.7, seeds=["An example seed."], evaluation=builtin)
    filters.feed(raw[:5], start=0)
    filters.feed(raw[5:], start=5)
    assert [i for i, _ in filters.kept] == [6, 8]
    # a follow-up turn that fails a filter ends its chat there: the turns before it are kept
    assert filters.kept[1][1] == ["Give me three tips for sleeping better.", "Sure.", "And for waking up?"]
    assert filters.dropped == {"empty": 1, "truncated": 1, "too short": 1, "too long": 1, "degenerate": 1,
                               "evaluation overlap": 1, "duplicate": 2, "follow-up: evaluation overlap": 1}
    assert set(filters.examples) == set(filters.dropped)


def test_the_stage_counts_reproduces_and_resumes(tmp_path, tiny_llama_dir):
    first = synthesize(str(tiny_llama_dir), tmp_path / "a", seed=3, **FAST)
    assert first["kept"] + sum(first["dropped"].values()) == 10
    records = [json.loads(line) for line in (tmp_path / "a" / "prompts.jsonl").read_text().splitlines()]
    assert len(records) == first["kept"] and all(r["messages"][-1]["role"] == "user" for r in records)
    assert (tmp_path / "a" / "lengths.png").stat().st_size > 0
    again = synthesize(str(tiny_llama_dir), tmp_path / "b", seed=3, **FAST)
    assert _raw(tmp_path / "b") == _raw(tmp_path / "a") and again["kept"] == first["kept"]
    # a kill after the first block, in the middle of writing the second: the rerun draws the rest as before
    journal = tmp_path / "b" / "partial.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text(lines[0] + lines[1][: len(lines[1]) // 2])
    (tmp_path / "b" / "prompts.jsonl").unlink()
    synthesize(str(tiny_llama_dir), tmp_path / "b", seed=3, **FAST)
    assert _raw(tmp_path / "b") == _raw(tmp_path / "a")
    assert (tmp_path / "b" / "prompts.jsonl").read_text() == (tmp_path / "a" / "prompts.jsonl").read_text()
    other = synthesize(str(tiny_llama_dir), tmp_path / "c", seed=4, **FAST)
    assert _raw(tmp_path / "c") != _raw(tmp_path / "a") and other["count"] == 10
    with pytest.raises(UserError, match="other settings \\(seed\\)"):
        synthesize(str(tiny_llama_dir), tmp_path / "a", seed=4, **FAST)


def _raw(out: Path) -> list:
    entries = [json.loads(line) for line in (out / "partial.jsonl").read_text().splitlines()]
    return [item for entry in sorted(entries, key=lambda e: e["block"]) for item in entry["items"]]


def test_bad_options_are_one_line(tmp_path, tiny_llama_dir):
    with pytest.raises(UserError, match="temperature must be above 0"):
        synthesize(str(tiny_llama_dir), tmp_path / "x", temperature=0.0, **FAST)
    with pytest.raises(UserError, match="--seed-prompts .*holds no prompts"):
        (tmp_path / "empty.txt").write_text("\n")
        synthesize(str(tiny_llama_dir), tmp_path / "x", seed_prompts=tmp_path / "empty.txt", **FAST)



def test_local_completions_of_prompts_of_different_lengths_are_each_their_own(tiny_llama_dir, smollm2_tokenizer):
    """Follow-up turns are asked in batches of chats of different lengths (left padding): greedy, each prompt's
    completion equals the one it gets alone."""
    from transformers import AutoModelForCausalLM

    from tiny_speculators.data.completions import LocalCompleter

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    end = smollm2_tokenizer("<|im_end|>", add_special_tokens=False)["input_ids"]
    complete = LocalCompleter(model, smollm2_tokenizer, 1.0, end, "cpu", seed=0)
    prompts = [user_turn_prefix(smollm2_tokenizer, None)[0],
               user_turn_prefix(smollm2_tokenizer, "Be brief.", [{"role": "user", "content": "Hi there"},
                                                                {"role": "assistant", "content": "Hello!"}])[0]]
    assert len(prompts[0]) < len(prompts[1])
    together = complete(prompts, 0.0, 6)
    assert together == [complete([p], 0.0, 6)[0] for p in prompts]
    assert all(item["tokens"] == 6 and item["truncated"] for item in together)

