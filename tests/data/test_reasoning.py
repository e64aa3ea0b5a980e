"""Reasoning templates that rewrite assistant turns: each turn is trained in the text the verifier saw
while writing it, with the loss on that turn only.

DeepSeek-R1 keeps only what follows ``</think>`` of every assistant turn and opens ``<think>\\n`` in
its generation prompt, so no rendering of the conversation contains the reasoning: each turn becomes
``prompt + what the model wrote``. Qwen3 keeps the reasoning of turns after the last user message
and drops it before, so only earlier turns get their own samples.
"""

from __future__ import annotations

import pytest
from mask_checks import check

from tiny_speculators.data.chat import ChatRenderer, RecordError, _overlap

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
R1_CHAT = [{"role": "user", "content": "2+2?"},
           {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
           {"role": "user", "content": "and 3+3?"},
           {"role": "assistant", "content": "<think>\nagain\n</think>\n\n6"}]


def test_overlap():
    assert _overlap("<think>\nr\n</think>\n\nanswer", "\n\nanswer<eos>") == len("\n\nanswer")
    assert _overlap("abcabc", "abcabx") == 3 and _overlap("aaa", "aaaa") == 3
    assert _overlap("", "x") == 0 and _overlap("x", "") == 0 and _overlap("abc", "xyz") == 0


def test_r1_multi_turn_one_sample_per_turn(r1_tokenizer):
    tok = r1_tokenizer
    second, first = ChatRenderer(tok).samples(R1_CHAT)
    # turn 3 after the first turn as R1 re-renders it (reasoning dropped) and its own generation prompt
    check(tok, second, [
        (BOS + "<｜User｜>2+2?<｜Assistant｜>\n\n4" + EOS + "<｜User｜>and 3+3?<｜Assistant｜><think>\n", 0),
        ("again\n</think>\n\n6" + EOS, 1),
    ], ["again", "\n", "</think>", "\n\n6", EOS])
    check(tok, first, [
        (BOS + "<｜User｜>2+2?<｜Assistant｜><think>\n", 0),
        ("add them\n</think>\n\n4" + EOS, 1),
    ], ["add them", "\n", "</think>", "\n\n4", EOS])
    assert (second.turns, first.turns) == ([3], [1])
    # what the server renders for the second prompt is exactly the unmasked part of that sample
    prompt = tok.apply_chat_template(R1_CHAT[:3], tokenize=False, add_generation_prompt=True)
    assert second.text.startswith(prompt) and second.spans == [(len(prompt), len(second.text))]


def test_r1_reasoning_content_field_is_written_as_the_model_writes_it(r1_tokenizer):
    """R1's template never reads reasoning_content: it is folded into the content rather than lost."""
    split = [{**m, "content": m["content"].split("</think>\n\n")[-1],
              "reasoning_content": m["content"].split("</think>")[0].removeprefix("<think>\n").strip()}
             if m["role"] == "assistant" else m for m in R1_CHAT]
    assert split[1] == {"role": "assistant", "content": "4", "reasoning_content": "add them"}
    renderer = ChatRenderer(r1_tokenizer)
    assert [s.text for s in renderer.samples(split)] == [s.text for s in renderer.samples(R1_CHAT)]


def test_r1_data_without_reasoning_is_reported(r1_tokenizer):
    with pytest.raises(RecordError) as e:
        ChatRenderer(r1_tokenizer).samples([{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "hello"}])
    assert e.value.reason == "template inconsistency" and "<think>" in e.value.detail
    with pytest.raises(RecordError, match="rewritten turns"):
        ChatRenderer(r1_tokenizer, rewritten_turns="drop").samples(R1_CHAT)


def test_qwen3_thinking_three_turns(qwen3_tokenizer):
    """Reasoning of turns before the last user message is dropped in later context: those turns are split off."""
    tok = qwen3_tokenizer
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "add"},
                {"role": "user", "content": "3+3?"},
                {"role": "assistant", "content": "6", "reasoning_content": "add again"}]
    full, second, first = ChatRenderer(tok).samples(messages)
    check(tok, full, [
        ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
         "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("<think>\nadd again\n</think>\n\n6<|im_end|>", 1),
        ("\n", 0),
    ], ["<think>", "\nadd again\n", "</think>", "\n\n6", "<|im_end|>"])
    check(tok, second, [
        ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
         "<|im_start|>assistant\n", 0),
        ("<think>\nadd\n</think>\n\n4<|im_end|>", 1),
        ("\n", 0),
    ], ["<think>", "\nadd\n", "</think>", "\n\n4", "<|im_end|>"])
    check(tok, first, [
        ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
        ("<think>\ngreet\n</think>\n\nHello!<|im_end|>", 1),
        ("\n", 0),
    ], ["<think>", "\ngreet\n", "</think>", "\n\nHello!", "<|im_end|>"])
    assert [s.turns for s in (full, second, first)] == [[5], [3], [1]]


def test_qwen3_tool_loop_after_the_last_question_stays_one_sample(qwen3_tokenizer):
    """Turns after the last user message keep their reasoning in the full render: no split needed."""
    call = {"type": "function", "function": {"name": "calc", "arguments": {"expr": "2+2"}}}
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "", "reasoning_content": "use the tool", "tool_calls": [call]},
                {"role": "tool", "content": "4"},
                {"role": "assistant", "content": "4", "reasoning_content": "the tool said 4"}]
    [sample] = ChatRenderer(qwen3_tokenizer).samples(messages, tools=[{"type": "function", "function": {
        "name": "calc", "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}])
    assert sample.turns == [1, 3]
    masked = [qwen3_tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m])]
    assert "use the tool" in masked[0] and "the tool said 4" in masked[0] and "<tool_response>" not in masked[0]
