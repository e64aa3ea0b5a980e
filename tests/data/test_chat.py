"""Loss masks, token by token, against hand-written expectations for four template families.

Each expectation lists the rendered text as consecutive (text, mask) pieces; the test checks that
every token falls in a piece with its mask value (the decoded runs of equal mask must equal the
pieces exactly), and that the masked ids equal an independent tokenization of the assistant text.
"""

from __future__ import annotations

import pytest
from mask_checks import check, runs

from tiny_speculators.data.chat import ChatRenderer, RecordError, masked_text
from tiny_speculators.errors import UserError

SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def test_smollm2_multi_turn_with_system_prompt(smollm2_tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome, since 1871."},
    ]
    [sample] = ChatRenderer(smollm2_tokenizer).samples(messages)
    check(smollm2_tokenizer, sample, [
        ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
         "<|im_start|>assistant\n", 0),
        ("Paris.<|im_end|>", 1),
        ("\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Rome, since 1871.<|im_end|>", 1),
        ("\n", 0),
    ], ["Paris.", "<|im_end|>", "Rome, since 1871.", "<|im_end|>"])
    assert sample.turns == [2, 4] and sample.boundary_tokens == 0
    end = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    # both end-of-turn tokens of assistant turns are masked, the user turn's one is not
    assert [m for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if t == end] == [0, 0, 1, 0, 1]


def test_smollm2_default_system_prompt_single_turn(smollm2_tokenizer):
    [sample] = ChatRenderer(smollm2_tokenizer).samples([{"role": "user", "content": "hi"},
                                                        {"role": "assistant", "content": "Hello! How can I help?"}])
    check(smollm2_tokenizer, sample, [
        (SMOL_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Hello! How can I help?<|im_end|>", 1),
        ("\n", 0),
    ], ["Hello! How can I help?", "<|im_end|>"])
    # by hand: the masked tokens are exactly these pieces
    assert smollm2_tokenizer.convert_ids_to_tokens(
        [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
    ) == ["Hello", "!", "ĠHow", "Ġcan", "ĠI", "Ġhelp", "?", "<|im_end|>"]


def test_last_turn_only_and_trailing_user_turn(smollm2_tokenizer):
    messages = [{"role": "user", "content": "a?"}, {"role": "assistant", "content": "A."},
                {"role": "user", "content": "b?"}, {"role": "assistant", "content": "B."},
                {"role": "user", "content": "unanswered"}]
    [sample] = ChatRenderer(smollm2_tokenizer, last_turn_only=True).samples(messages)
    assert "unanswered" not in sample.text  # trailing non-assistant turns carry no signal
    assert masked_text(smollm2_tokenizer, sample) == ["B.<|im_end|>"]
    assert runs(smollm2_tokenizer, sample)[-2:] == [("B.<|im_end|>", 1), ("\n", 0)]


def test_qwen3_tokenizer_is_real(qwen3_tokenizer):
    tok = qwen3_tokenizer
    assert len(tok) == 151669
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]) == \
        [151643, 151644, 151645, 151667, 151668]
    assert tok.encode("Hello world!", add_special_tokens=False) == [9707, 1879, 0]  # Qwen's published ids
    assert tok.encode("12345", add_special_tokens=False) == [16, 17, 18, 19, 20]  # digits split one by one
    text = "Grüße, 你好! <think>x</think>\n\n  tabs\tand\r\nnewlines 🙂"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


QWEN_Q = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("enable_thinking", [None, True])
def test_qwen3_thinking_on(qwen3_tokenizer, enable_thinking):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "<think>\nTwo plus two.\n</think>\n\n4"}]
    [sample] = ChatRenderer(qwen3_tokenizer, enable_thinking=enable_thinking).samples(messages)
    check(qwen3_tokenizer, sample, [
        (QWEN_Q, 0),
        ("<think>\nTwo plus two.\n</think>\n\n4<|im_end|>", 1),  # the model writes its own <think> block
        ("\n", 0),
    ], ["<think>", "\nTwo plus two.\n", "</think>", "\n\n4", "<|im_end|>"])


def test_qwen3_thinking_off(qwen3_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4"}]
    [sample] = ChatRenderer(qwen3_tokenizer, enable_thinking=False).samples(messages)
    check(qwen3_tokenizer, sample, [
        (QWEN_Q + "<think>\n\n</think>\n\n", 0),  # the empty think block is part of the generation prompt
        ("4<|im_end|>", 1),
        ("\n", 0),
    ], ["4", "<|im_end|>"])
    # thinking off, but the data holds reasoning: the template cannot render it consistently -> reported
    with pytest.raises(RecordError) as e:
        ChatRenderer(qwen3_tokenizer, enable_thinking=False).samples(
            [*messages[:2], {"role": "assistant", "content": "<think>\nhm\n</think>\n\n4"}])
    assert e.value.reason == "template inconsistency"


def test_qwen3_multi_turn_rewritten_history_is_split(qwen3_tokenizer):
    """Qwen3 drops <think> from assistant turns before the last user turn: each turn gets the text it was written in."""
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "<think>\ngreet\n</think>\n\nHello!"},
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}]
    full, first = ChatRenderer(qwen3_tokenizer).samples(messages)
    check(qwen3_tokenizer, full, [
        ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"  # rewritten: not masked
         "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("<think>\nadd\n</think>\n\n4<|im_end|>", 1),
        ("\n", 0),
    ], ["<think>", "\nadd\n", "</think>", "\n\n4", "<|im_end|>"])
    check(qwen3_tokenizer, first, [
        ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
        ("<think>\ngreet\n</think>\n\nHello!<|im_end|>", 1),
        ("\n", 0),
    ], ["<think>", "\ngreet\n", "</think>", "\n\nHello!", "<|im_end|>"])
    assert (full.turns, first.turns) == ([3], [1])
    with pytest.raises(RecordError) as e:
        ChatRenderer(qwen3_tokenizer, rewritten_turns="drop").samples(messages)
    assert e.value.reason == "rewritten turns"
    # last turn only: no rewriting issue, one sample
    [last] = ChatRenderer(qwen3_tokenizer, last_turn_only=True).samples(messages)
    assert last.text == full.text and last.loss_mask == full.loss_mask


def test_qwen3_multi_turn_thinking_off(qwen3_tokenizer):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    full, first = ChatRenderer(qwen3_tokenizer, enable_thinking=False).samples(messages)
    check(qwen3_tokenizer, full, [
        ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
         "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", 0),
        ("4<|im_end|>", 1),
        ("\n", 0),
    ], ["4", "<|im_end|>"])
    check(qwen3_tokenizer, first, [
        ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", 0),
        ("Hello!<|im_end|>", 1),
        ("\n", 0),
    ], ["Hello!", "<|im_end|>"])


def test_qwen3_reasoning_content_field(qwen3_tokenizer):
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "add them"}]
    [sample] = ChatRenderer(qwen3_tokenizer).samples(messages)
    assert masked_text(qwen3_tokenizer, sample) == ["<think>\nadd them\n</think>\n\n4<|im_end|>"]


def test_llama3_template_multi_turn_with_system(llama3_tokenizer):
    messages = [{"role": "system", "content": "You are a pirate."},
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Ahoy, matey!"},
                {"role": "user", "content": "Where is the treasure?"},
                {"role": "assistant", "content": " Buried on the island. "}]  # the template trims content
    [sample] = ChatRenderer(llama3_tokenizer).samples(messages)
    check(llama3_tokenizer, sample, [
        ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a pirate.<|eot_id|>"
         "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
         "<|start_header_id|>assistant<|end_header_id|>\n\n", 0),
        ("Ahoy, matey!<|eot_id|>", 1),
        ("<|start_header_id|>user<|end_header_id|>\n\nWhere is the treasure?<|eot_id|>"
         "<|start_header_id|>assistant<|end_header_id|>\n\n", 0),
        ("Buried on the island.<|eot_id|>", 1),
    ], ["Ahoy, matey!", "<|eot_id|>", "Buried on the island.", "<|eot_id|>"])


def test_template_errors_and_missing_template(smollm2_tokenizer, alternating_template):
    renderer = ChatRenderer(smollm2_tokenizer, chat_template=alternating_template.read_text())
    with pytest.raises(RecordError) as e:
        renderer.samples([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                          {"role": "assistant", "content": "c"}])
    assert e.value.reason == "template error" and "alternate" in e.value.detail
    with pytest.raises(RecordError, match="no assistant turn"):
        renderer.samples([{"role": "user", "content": "a"}])
    bare = type(smollm2_tokenizer).from_pretrained(smollm2_tokenizer.name_or_path)
    bare.chat_template = None
    with pytest.raises(UserError, match="no chat template"):
        ChatRenderer(bare)


GENERATION_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_prefix_diff_agrees_with_generation_markers(smollm2_tokenizer):
    """Where a template marks assistant text with {% generation %}, transformers' own mask is an independent oracle."""
    import random

    rng = random.Random(0)
    words = ["alpha", "beta", " gamma", "42", "!", "\n", "naïve", "x y", "<tag>", "  "]
    renderer = ChatRenderer(smollm2_tokenizer, chat_template=GENERATION_TEMPLATE)
    boundaries = 0
    for _ in range(25):
        messages = [{"role": "system", "content": "sys"}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 4)):
            for role in ("user", "assistant"):
                messages.append({"role": role, "content": "".join(rng.choices(words, k=rng.randint(1, 6))) + "."})
        [sample] = renderer.samples(messages)
        oracle = smollm2_tokenizer.apply_chat_template(
            messages, chat_template=GENERATION_TEMPLATE, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True)
        assert sample.input_ids == list(oracle["input_ids"])
        assert sample.loss_mask == list(oracle["assistant_masks"])
        expected = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        boundaries += sample.boundary_tokens
        if sample.boundary_tokens == 0:  # else a token like "\n " also holds the header's newline
            assert masked_text(smollm2_tokenizer, sample) == expected
        else:
            assert all(got.endswith(want) for got, want in zip(masked_text(smollm2_tokenizer, sample), expected,
                                                               strict=True))
    assert boundaries > 0  # the seed covers answers whose first token merges with the header's newline
