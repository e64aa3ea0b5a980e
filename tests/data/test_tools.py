"""Tool calling through the verifiers' own templates: the loss is on what the assistant writes (its
text, its tool-call tokens, its end-of-turn token), never on tool results, tool definitions or prompts.

Qwen3 runs on its real vocabulary; Llama-3.1 and Mistral v0.3 use their published templates with
their control tokens added to SmolLM2's vocabulary (fixtures/README.md).
"""

from __future__ import annotations

import json

import pytest
from mask_checks import check, runs

from tiny_speculators.data.chat import ChatRenderer, RecordError, masked_text
from tiny_speculators.data.layouts import normalize_record

WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOLS = [{"type": "function", "function": WEATHER}]
CALL = {"type": "function", "id": "call12345", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
RESULT = '{"temp_c": 21}'


def weather_chat(system: bool = True) -> list[dict]:
    return [*([{"role": "system", "content": "Be brief."}] if system else []),
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "content": RESULT, "tool_call_id": "call12345"},
            {"role": "assistant", "content": "It is 21 °C."}]


def assert_never_masked(tokenizer, sample, *texts):
    for got in masked_text(tokenizer, sample):
        for text in texts:
            assert text not in got


QWEN_TOOLS_SYSTEM = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TOOLS[0], ensure_ascii=False)
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call><|im_end|>\n"
)
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_qwen3_tool_call_and_answer(qwen3_tokenizer):
    tok = qwen3_tokenizer
    full, call = ChatRenderer(tok).samples(weather_chat(), tools=TOOLS)
    prompt = QWEN_TOOLS_SYSTEM + "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    # the final answer, in the whole conversation: the call and the tool result are context
    check(tok, full, [
        (prompt + QWEN_CALL + "<|im_end|>\n<|im_start|>user\n<tool_response>\n" + RESULT
         + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n", 0),
        ("<think>\n\n</think>\n\nIt is 21 °C.<|im_end|>", 1),
        ("\n", 0),
    ], ["<think>", "\n\n", "</think>", "\n\n", "It is 21 °C.", "<|im_end|>"])
    # the tool call as Qwen3 renders it while the model writes it (an empty think block first): its own sample
    check(tok, call, [
        (prompt, 0),
        ("<think>\n\n</think>\n\n" + QWEN_CALL + "<|im_end|>", 1),
        ("\n", 0),
    ], ["<think>", "\n\n", "</think>", "\n\n", "<tool_call>",
        '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "</tool_call>", "<|im_end|>"])
    assert (full.turns, call.turns) == ([4], [2])
    for sample in (full, call):
        assert_never_masked(tok, sample, "temp_c", "Weather in Paris", "get_weather\", \"description")


def test_qwen3_parallel_calls_with_text(qwen3_tokenizer):
    second = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
    messages = [{"role": "user", "content": "Paris and Rome?"},
                {"role": "assistant", "content": "Checking both.", "tool_calls": [CALL, second]}]
    [sample] = ChatRenderer(qwen3_tokenizer).samples(messages, tools=TOOLS)
    [masked] = [text for text, m in runs(qwen3_tokenizer, sample) if m]
    assert masked == ("<think>\n\n</think>\n\nChecking both.\n" + QWEN_CALL + "\n"
                      + QWEN_CALL.replace("Paris", "Rome") + "<|im_end|>")


LLAMA_SYSTEM = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
                "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|>")


def test_llama31_tool_call_and_answer(llama31_tokenizer):
    tok = llama31_tokenizer
    [sample] = ChatRenderer(tok).samples(weather_chat(), tools=TOOLS)
    tools_json = json.dumps(TOOLS[0], indent=4, ensure_ascii=False)
    check(tok, sample, [
        (LLAMA_SYSTEM + "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond "
         "with a JSON for a function call with its proper arguments that best answers the given prompt.\n\n"
         'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
         "Do not use variables.\n\n" + tools_json + "\n\nWeather in Paris?<|eot_id|>"
         "<|start_header_id|>assistant<|end_header_id|>\n\n", 0),
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', 1),
        # Llama-3.1's template writes a string tool result through tojson: quoted, as the model saw it
        ("<|start_header_id|>ipython<|end_header_id|>\n\n" + json.dumps(RESULT) + "<|eot_id|>"
         "<|start_header_id|>assistant<|end_header_id|>\n\n", 0),
        ("It is 21 °C.<|eot_id|>", 1),
    ], ['{"name": "get_weather", "parameters": {"city": "Paris"}}', "<|eot_id|>", "It is 21 °C.", "<|eot_id|>"])
    assert sample.turns == [2, 4]
    assert_never_masked(tok, sample, "temp_c", "Weather in Paris", "Given the following functions")


def test_llama31_refuses_parallel_calls_as_a_record_error(llama31_tokenizer):
    messages = [{"role": "user", "content": "Paris and Rome?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL, CALL]}]
    with pytest.raises(RecordError) as e:
        ChatRenderer(llama31_tokenizer).samples(messages, tools=TOOLS)
    assert e.value.reason == "template error" and "single tool-calls" in e.value.detail


MISTRAL_TOOLS = ('[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather", "description": '
                 '"Current weather in a city", "parameters": ' + json.dumps(WEATHER["parameters"]) + '}}]'
                 "[/AVAILABLE_TOOLS]")
MISTRAL_CALL = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call12345"}]</s>'


def test_mistral_tool_call_answer_and_moved_tool_block(mistral_tokenizer):
    tok = mistral_tokenizer
    messages = [*weather_chat(system=False), {"role": "user", "content": "And tomorrow?"},
                {"role": "assistant", "content": "No forecast."}]
    full, early = ChatRenderer(tok).samples(messages, tools=TOOLS)
    result = '[TOOL_RESULTS] {"content": ' + RESULT + ', "call_id": "call12345"}[/TOOL_RESULTS]'
    # Mistral puts the tool definitions before the LAST user message: the whole conversation shows the
    # earlier turns in another context than the one they were written in, so they get their own sample
    check(tok, full, [
        ("<s>[INST] Weather in Paris?[/INST]" + MISTRAL_CALL + result + " It is 21 °C.</s>" + MISTRAL_TOOLS
         + "[INST] And tomorrow?[/INST]", 0),
        (" No forecast.</s>", 1),
    ], [" No forecast.", "</s>"])
    check(tok, early, [
        ("<s>" + MISTRAL_TOOLS + "[INST] Weather in Paris?[/INST]", 0),
        (MISTRAL_CALL, 1),
        (result, 0),
        (" It is 21 °C.</s>", 1),
    ], ["[TOOL_CALLS]", ' [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call12345"}]', "</s>",
        " It is 21 °C.", "</s>"])
    assert (full.turns, early.turns) == ([5], [1, 3])


def test_sharegpt_function_call_layout_renders_like_openai(qwen3_tokenizer):
    """LLaMA-Factory's function_call/observation turns and tools string give the same samples as OpenAI's layout."""
    sharegpt = {"conversations": [{"from": "system", "value": "Be brief."},
                                  {"from": "human", "value": "Weather in Paris?"},
                                  {"from": "function_call", "value": json.dumps({"name": "get_weather",
                                                                                 "arguments": {"city": "Paris"}})},
                                  {"from": "observation", "value": RESULT},
                                  {"from": "gpt", "value": "It is 21 °C."}],
                "tools": json.dumps(TOOLS)}
    openai = {"messages": [{**m, "tool_calls": [{**CALL, "function": {**CALL["function"],
                                                                      "arguments": '{"city": "Paris"}'}}]}
                           if m.get("tool_calls") else m for m in weather_chat()], "tools": TOOLS}
    renderer = ChatRenderer(qwen3_tokenizer)
    a = renderer.samples(*normalize_record(sharegpt))
    b = renderer.samples(*normalize_record(openai))
    assert [(s.input_ids, s.loss_mask) for s in a] == [(s.input_ids, s.loss_mask) for s in b]
