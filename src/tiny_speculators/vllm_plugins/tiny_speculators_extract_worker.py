"""The vLLM side of ``extract --backend vllm``: an offline ``vllm.LLM`` that prefills token ids and saves hidden states.

Runs INSIDE the vLLM environment (started by :mod:`tiny_speculators.verifier.vllm_extract` with that
environment's python), so it imports only vllm, torch and the standard library. The engine runs vLLM's
``extract_hidden_states`` speculative method with :mod:`tiny_speculators_connector`: every request is a
prompt of token ids with ``max_tokens=1``, and its hidden states (the inputs of the requested layers,
id N = the last layer's output before the final norm) land in one safetensors file per request.

Protocol: one JSON object per line. The worker answers ``{"ready": true}`` once the engine is up, then reads
``{"id": ..., "samples": [[token ids], ...]}`` lines from stdin and answers each with
``{"id": ..., "paths": [file per sample], "next": [greedy next token per sample], "seconds": s}`` once every
file is complete; EOF ends it. Answers go to the original stdout; everything vLLM prints goes to stderr (the
caller's log). With ``"layers": null`` it is plain vLLM prefill (no method, no files), what the benchmark
compares against.

    python tiny_speculators_extract_worker.py '{"model": "/path/to/verifier", "layers": [2, 15, 27, 30],
        "storage": "/tmp/hs", "dtype": "float32", "max_model_len": 2048}' < requests.jsonl
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from typing import Any

CONNECTOR = "TinySpeculatorsHiddenStatesConnector"
CONNECTOR_MODULE = "tiny_speculators_connector"


def engine_args(config: dict[str, Any]) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for a worker config (see the module docstring)."""
    kwargs: dict[str, Any] = {
        "model": config["model"], "dtype": config.get("dtype", "auto"), "seed": config.get("seed", 0),
        "max_model_len": config.get("max_model_len"), "enforce_eager": config.get("enforce_eager", True),
        "trust_remote_code": config.get("trust_remote_code", False), "enable_prefix_caching": False,
        "max_num_batched_tokens": config.get("max_num_batched_tokens"),
    }
    if config.get("layers") is not None:
        kwargs["speculative_config"] = {
            "method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(config["layers"])}}}
        kwargs["kv_transfer_config"] = {
            "kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": config["storage"]}}
    return {k: v for k, v in kwargs.items() if v is not None}


def wait_complete(path: str) -> None:
    """Block until the connector has released the file's lock (it holds it until the file is written)."""
    with open(path + ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
    os.remove(path + ".lock")


def main() -> None:
    config = json.loads(sys.argv[1])
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's own prints go to the log, never into the answers
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**engine_args(config))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    answers.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            break
        request = json.loads(line)
        start = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["samples"]], params,
                               use_tqdm=False)
        paths = []
        if config.get("layers") is not None:
            paths = [out.kv_transfer_params["hidden_states_path"] for out in outputs]
            for path in paths:
                wait_complete(path)
        # each prompt's greedy next token: the verifier's own choice, which the caller's guard checks states against
        next_tokens = [out.outputs[0].token_ids[0] if out.outputs and out.outputs[0].token_ids else None
                       for out in outputs]
        answers.write(json.dumps({"id": request["id"], "paths": paths, "next": next_tokens,
                                  "seconds": time.perf_counter() - start}) + "\n")


if __name__ == "__main__":
    main()
