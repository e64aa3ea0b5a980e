"""The load: GuideLLM (``guidellm run``, a subprocess) at one concurrency against an OpenAI-compatible server.

GuideLLM 0.8 is installed in the vLLM environment by ``scripts/vllm_env.sh`` (it needs torch, which that
environment has at vLLM's pin). Each run gets a scenario file: the chat-completions backend with greedy
sampling, a ``concurrent`` profile with N streams, a JSONL dataset whose rows hold the chat ``messages`` and
``output_tokens_count`` (GuideLLM then asks for exactly that many tokens with ``ignore_eos``, so every
request generates the same length with and without a draft), and a ``max_requests`` constraint. GuideLLM's
JSON report gives TTFT and ITL percentiles and the output-token and request rates.

    from tiny_speculators.benchmark.load import run_guidellm, write_dataset
    data = write_dataset(prompts, Path("runs/bench/requests.jsonl"), requests=8, output_tokens=32)
    result = run_guidellm(Path("~/.cache/tiny-speculators/vllm-venv/bin/guidellm"), target="http://127.0.0.1:8000",
                          model="HuggingFaceTB/SmolLM2-135M-Instruct", tokenizer="/path/to/verifier", data=data,
                          concurrency=2, requests=8, out_dir=Path("runs/bench/guidellm"), label="draft")
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tiny_speculators.errors import UserError
from tiny_speculators.evaluate.prompts import Prompt
from tiny_speculators.serving import clean_env

__all__ = ["GUIDELLM_VERSION", "LoadResult", "find_guidellm", "parse_report", "run_guidellm", "write_dataset"]

log = logging.getLogger(__name__)

GUIDELLM_VERSION = "0.8.1"  # what scripts/vllm_env.sh installs; the report schema below is this version's
PERCENTILES = ("p50", "p90", "p99")
_ERROR = re.compile(r"^(?:Error:|\S*(?:Error|Exception)\b:)\s*(.*\S)")


@dataclass(frozen=True)
class LoadResult:
    """One GuideLLM benchmark (one concurrency), in the units operators read."""

    concurrency: int
    requests_successful: int
    requests_errored: int
    requests_incomplete: int
    duration_s: float
    output_tokens: int  # generated tokens of the successful requests
    prompt_tokens: int
    ttft_ms: dict[str, float]  # mean, p50, p90, p99
    itl_ms: dict[str, float]
    output_tokens_per_s: float
    requests_per_s: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def find_guidellm(explicit: str | None, vllm_venv: Path) -> Path:
    """``explicit`` (a path or a name on PATH), else the ``guidellm`` of the vLLM environment."""
    if explicit:
        found = shutil.which(explicit)
        if found is None:
            raise UserError(f"--guidellm {explicit}: no such executable")
        return Path(found)
    exe = vllm_venv / "bin" / "guidellm"
    if not exe.is_file():
        raise UserError(f"GuideLLM is not installed in {vllm_venv}: run `bash scripts/vllm_env.sh` (it adds "
                        f"guidellm=={GUIDELLM_VERSION}) or pass --guidellm")
    return exe


def write_dataset(prompts: Sequence[Prompt], path: Path, *, requests: int, output_tokens: int) -> Path:
    """``requests`` rows of chat messages (prompts cycled in order) with a fixed output length, as JSONL."""
    if not prompts:
        raise UserError("there are no prompts to send")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for i in range(requests):
            prompt = prompts[i % len(prompts)]
            f.write(json.dumps({"id": f"{prompt.id}#{i}", "messages": prompt.messages,
                                "output_tokens_count": output_tokens}) + "\n")
    return path


def scenario(*, target: str, model: str, tokenizer: str, data: Path, concurrency: int, requests: int,
             report: Path, timeout: float) -> dict[str, Any]:
    """The GuideLLM scenario of one run (``guidellm run --scenario FILE``)."""
    return {
        "metadata": {"name": f"tiny-speculators concurrency {concurrency}"},
        "spec": {
            "backend": {"kind": "openai_http", "target": target, "model": model,
                        "request_format": "/v1/chat/completions", "timeout": timeout,
                        "extras": {"body": {"temperature": 0.0}}},
            "profile": {"kind": "concurrent", "streams": concurrency},
            "data": [{"kind": "json_file", "path": str(data)}],
            "tokenizer": {"kind": "huggingface_auto", "model": tokenizer},
            "constraints": [{"kind": "max_requests", "count": requests}],
            "outputs": [{"kind": "json", "path": str(report)}],
        },
    }


def _stat(metric: dict[str, Any], what: str) -> dict[str, float]:
    summary = (metric or {}).get("successful") or {}
    percentiles = summary.get("percentiles") or {}
    if "mean" not in summary or any(p not in percentiles for p in PERCENTILES):
        raise UserError(f"the GuideLLM report has no {what} statistics for successful requests")
    return {"mean": float(summary["mean"]), **{p: float(percentiles[p]) for p in PERCENTILES}}


def parse_report(path: Path) -> list[LoadResult]:
    """The benchmarks of a GuideLLM 0.8 JSON report, one per concurrency."""
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        benchmarks = report["benchmarks"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path} is not a GuideLLM JSON report ({e})") from None
    try:
        return [_result(bench) for bench in benchmarks]
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path} is not a GuideLLM {GUIDELLM_VERSION} report: it has no {e}") from None


def _result(bench: dict[str, Any]) -> LoadResult:
    metrics, strategy = bench["metrics"], bench["config"]["strategy"]
    totals = metrics["request_totals"]
    streams = strategy.get("streams")
    duration = float(bench["duration"])
    successful = int(totals["successful"])
    output_tokens = round(float(metrics["output_token_count"]["successful"]["total_sum"]))
    # rates are counts over the benchmark's duration, computed here: GuideLLM's own rate "mean" (0.8.1) merges
    # token events that share a timestamp, as a draft's accepted tokens do when they arrive in one streamed chunk
    # (measured: 27.47 tokens/s reported for 128 tokens in 4.615 s, 27.74)
    return LoadResult(
        concurrency=int(streams if streams is not None else strategy.get("max_concurrency") or 0),
        requests_successful=successful, requests_errored=int(totals["errored"]),
        requests_incomplete=int(totals["incomplete"]), duration_s=duration, output_tokens=output_tokens,
        prompt_tokens=round(float(metrics["prompt_token_count"]["successful"]["total_sum"])),
        ttft_ms=_stat(metrics["time_to_first_token_ms"], "time-to-first-token"),
        itl_ms=_stat(metrics["inter_token_latency_ms"], "inter-token-latency"),
        output_tokens_per_s=output_tokens / duration if duration > 0 else 0.0,
        requests_per_s=successful / duration if duration > 0 else 0.0,
    )


def _guidellm_error(log_text: str) -> str | None:
    lines = [m.group(0).strip() for line in log_text.splitlines() if (m := _ERROR.match(line.strip()))]
    if lines:
        return lines[-1]
    rest = [line.strip() for line in log_text.splitlines() if line.strip().startswith("- ")]
    return rest[-1] if rest else None


def run_guidellm(exe: Path, *, target: str, model: str, tokenizer: str, data: Path, concurrency: int,
                 requests: int, out_dir: Path, label: str, timeout: float = 3600.0) -> LoadResult:
    """One GuideLLM run: ``requests`` requests at ``concurrency`` streams; its scenario, log and report
    stay in ``out_dir`` as ``{label}-c{concurrency}.*``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{label}-c{concurrency}"
    report, log_path = stem.with_suffix(".json"), stem.with_suffix(".log")
    report.unlink(missing_ok=True)
    scenario_path = stem.with_suffix(".scenario.json")
    scenario_path.write_text(json.dumps(scenario(target=target, model=model, tokenizer=tokenizer, data=data,
                                                 concurrency=concurrency, requests=requests, report=report,
                                                 timeout=timeout), indent=2))
    cmd = [str(exe), "run", "--scenario", str(scenario_path), "--disable-console-interactive"]
    env = clean_env()
    if Path(tokenizer).is_dir():
        env.setdefault("HF_HUB_OFFLINE", "1")
    log.info("guidellm: %s, concurrency %d, %d requests", label, concurrency, requests)
    with log_path.open("wb") as f:
        f.write(("$ " + " ".join(cmd) + "\n").encode())
        f.flush()
        # no wall-clock limit: the run is bounded by its request count and each request by ``timeout``.
        # GuideLLM forks and spawns workers: it runs in its own process group, which is stopped as a whole
        # when it ends or when this process is interrupted (killing the first pid alone left orphans behind)
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        try:
            proc.wait()
        finally:
            _stop_group(proc)
    if proc.returncode != 0 or not report.is_file():
        reason = _guidellm_error(log_path.read_text(encoding="utf-8", errors="replace"))
        raise UserError(f"GuideLLM failed at concurrency {concurrency} against {target}: "
                        f"{reason or f'exit code {proc.returncode}'} (log: {log_path})")
    (result,) = parse_report(report)
    if result.requests_successful == 0:
        raise UserError(f"GuideLLM: every request to {target} failed at concurrency {concurrency} "
                        f"(report: {report})")
    if result.requests_errored or result.requests_incomplete:
        log.warning("guidellm: %d of %d requests failed at concurrency %d (report: %s)", result.requests_errored,
                    requests, concurrency, report)
    return result


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of ``proc``'s process group (its forked and spawned workers), then reap ``proc``."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
