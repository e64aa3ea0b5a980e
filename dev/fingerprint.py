"""Behaviour fingerprint of every draft family, for refactors that must change nothing.

Runs each family through the stages a user runs (prepare -> vocab -> extract -> train -> export in every format ->
evaluate) on tiny random verifiers, plus one objective step and one proposal on a seeded draft, and prints one
sha256 per artifact: state dicts, exported configs and tensors, losses and gradients, proposed tokens, acceptance
counters. Timings and paths are left out. Run it before and after a change, and compare the two files:

    PYTHONPATH=src python dev/fingerprint.py --out /tmp/before.json     # on the old commit
    PYTHONPATH=src python dev/fingerprint.py --out /tmp/after.json      # on the new one
    python dev/fingerprint.py --compare /tmp/before.json /tmp/after.json

Takes ~2-3 minutes on 2 CPU cores. It speaks only through the stage table and the family table, so it runs on
both sides of a refactor that moves modules.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

REPO = Path.cwd()  # run from the repository root (its tests/ holds the tiny verifiers)
CHATS = [
    [{"role": "user", "content": f"Question {i}: what is {i} plus {i + 1}?"},
     {"role": "assistant", "content": f"{i} plus {i + 1} is {2 * i + 1}. Anything else I can add up for you?"}]
    for i in range(12)
]
PROMPTS = [{"prompt": "What is 3 plus 4?"}, {"prompt": "Name a colour."}]
VOLATILE_WORDS = ("time", "second", "elapsed", "wall", "date", "path", "dir", "created", "version", "speed",
                  "throughput", "rss", "memory", "per_s", "_ms")
VOLATILE_KEYS = {"out", "data", "verifier", "hidden_states", "vocab", "draft", "checkpoint", "source", "prompts"}


def _volatile(key: Any) -> bool:
    """Timings, paths, versions: what differs between two runs of the same code."""
    k = str(key).lower()
    return k in VOLATILE_KEYS or k.endswith(("_s", "_sec")) or any(word in k for word in VOLATILE_WORDS)


def _digest(value: Any) -> str:
    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()[:16]


def _feed(h, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            h.update(str(k).encode())
            _feed(h, value[k])
    elif isinstance(value, (list, tuple)):
        for v in value:
            _feed(h, v)
    else:
        h.update(repr(value).encode())


def _stable(record: Any) -> Any:
    """A JSON record without timings, paths and versions."""
    if isinstance(record, dict):
        return {k: _stable(v) for k, v in record.items() if not _volatile(k)}
    if isinstance(record, list):
        return [_stable(v) for v in record]
    if isinstance(record, str) and ("/" in record or "\\" in record):
        return "<path>"
    return record


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update({f"{f.name}:{k}": v for k, v in load_file(str(f)).items()})
    return out


def _jsons(folder: Path) -> dict[str, Any]:
    return {f.name: _stable(json.loads(f.read_text())) for f in sorted(folder.glob("*.json"))}


def _losses(train_out: Path) -> list[Any]:
    rows = []
    for f in sorted(train_out.rglob("*.jsonl")):
        if "samples" in f.name:
            continue
        for line in f.read_text().splitlines():
            row = json.loads(line)
            rows.append({k: v for k, v in sorted(row.items()) if isinstance(v, (int, float)) and not isinstance(v, bool)
                         and not _volatile(k)})
    return rows


def _stage(name: str):
    from tiny_speculators.stages import load_stage

    return load_stage(name)


def _verifiers(root: Path, tokenizer) -> dict[str, Path]:
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import make_tiny_mimo, make_tiny_verifier  # the test suite's tiny verifiers

    return {"llama": make_tiny_verifier(root / "tiny-llama", "llama", tokenizer),
            "mimo": make_tiny_mimo(root / "tiny-mimo", tokenizer)}


def _data(root: Path, verifier: Path) -> tuple[Path, Path, Path]:
    """Prepared data, draft vocabulary and hidden states for ``verifier`` (made once per verifier)."""
    chats = root / "chats.jsonl"
    if not chats.exists():
        chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    layers = [2, 4, 5]  # a family with fixed aux layers (MTP) reads the last state, which every extraction stores
    prepared, vocab, hs = root / f"prep-{verifier.name}", root / f"vocab-{verifier.name}", root / f"hs-{verifier.name}"
    if not prepared.exists():
        _stage("prepare")(verifier=str(verifier), data=[chats], out=prepared)
        _stage("vocab")(data=prepared, out=vocab, size=256)
    if not hs.exists():
        _stage("extract")(verifier=str(verifier), data=prepared, out=hs, layers=layers, progress=False)
    return prepared, vocab, hs


def _objective_and_proposal(family, verifier: Path, vocab: Path) -> dict[str, str]:
    """One seeded objective step (loss, every gradient) and one 3-token proposal, through the seam."""
    from safetensors.torch import load_file

    from tiny_speculators.models.family import BuildInputs
    from tiny_speculators.verifier.capture import capture_hidden_states
    from tiny_speculators.verifier.head import load_verifier_head
    from tiny_speculators.verifier.load import load_verifier

    model, _ = load_verifier(str(verifier), with_tokenizer=False)
    head = load_verifier_head(str(verifier))
    maps = load_file(str(vocab / "vocab.safetensors"))
    aux_ids = family.default_aux_layer_ids(model.config.num_hidden_layers) if family.fixed_aux_layer_ids else [2, 4, 5]
    inputs = BuildInputs(verifier_config=head.config, d2t=maps["d2t"], t2d=maps["t2d"], aux_layer_ids=[2, 4, 5],
                         embed_weight=head.embed_weight.float(), lm_head_weight=head.target_head.lm_head.weight.float(),
                         verifier_path=str(verifier))
    torch.manual_seed(0)
    draft = family.build(inputs, family.options())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=g)
    aux, last = capture_hidden_states(model, ids, torch.ones_like(ids), aux_ids)
    mask = torch.ones(2, 24)
    mask[:, :4] = 0
    batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids),
             "position_ids": torch.arange(24).expand(2, 24), "aux_hidden_states": aux.clone(),
             "last_hidden_state": last.clone()}
    objective = family.objective(draft, head.target_head, family.options(), "sdpa")
    torch.manual_seed(1)
    counts = objective.loss_counts(batch)
    out = objective(batch, counts.float().clamp(min=1))
    out.loss.backward()
    grads = {n: p.grad for n, p in draft.named_parameters() if p.grad is not None}
    result = {"init_state": _digest(draft.state_dict()), "loss": repr(out.loss.item()), "grads": _digest(grads),
              "metrics": _digest(dict(out.metrics))}
    proposer = family.proposer(draft.eval())
    proposer.reset()
    first = ids[0, :10].tolist()
    proposer.commit([*first[1:], first[0]], aux[0, :10], 0)
    params = _sampling_params()
    torch.manual_seed(2)
    tokens, _ = proposer.propose_chain(3, params, None)
    result["proposal"] = repr(list(tokens))
    return result


def _sampling_params():
    for module in ("tiny_speculators.sampling", "tiny_speculators.evaluate.sampling"):
        try:
            return __import__(module, fromlist=["SamplingParams"]).SamplingParams()
        except (ImportError, AttributeError):
            continue
    raise ImportError("SamplingParams not found")


def fingerprint(root: Path) -> dict[str, dict[str, str]]:
    from transformers import AutoTokenizer

    from tiny_speculators.models import FAMILIES
    from tiny_speculators.verifier.embedded import embedded_verifier_dir

    tokenizer = AutoTokenizer.from_pretrained(embedded_verifier_dir("smollm2-135m"))
    verifiers = _verifiers(root, tokenizer)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    result: dict[str, dict[str, str]] = {}
    for name, family in FAMILIES.items():
        verifier = verifiers["mimo" if family.reads_verifier_files else "llama"]
        _, vocab, hs = _data(root, verifier)
        entry = _objective_and_proposal(family, verifier, vocab)
        out = root / f"train-{name}"
        _stage("train")(verifier=str(verifier), out=out, vocab=vocab, hidden_states=hs, algorithm=name, max_steps=4,
                        batch_size=2, lr=1e-3, eval_fraction=0.2, eval_every=2, save_every=2, seed=0, progress=False)
        final = sorted(p for p in out.iterdir() if p.is_dir() and (p / "model.safetensors").exists())
        entry["checkpoints"] = _digest({p.name: _tensors(p) for p in final})
        entry["checkpoint_configs"] = _digest({p.name: _jsons(p) for p in final})
        entry["losses"] = _digest(_losses(out))
        for fmt in family.formats:
            exported = root / f"export-{name}-{fmt.name}"
            _stage("export")(out, out=exported, format=fmt.name)
            entry[f"export:{fmt.name}:tensors"] = _digest(_tensors(exported))
            entry[f"export:{fmt.name}:config"] = _digest(_jsons(exported))
        evaluated = root / f"eval-{name}"
        results = _stage("evaluate")(verifier=str(verifier), draft=out, out=evaluated, prompts=str(prompts), k=3,
                                     max_new_tokens=12, baseline=False)
        entry["evaluate"] = _digest(_stable(results))
        entry["evaluate_files"] = _digest(_jsons(evaluated))  # per-prompt tokens included
        result[name] = entry
        print(name, json.dumps(entry), flush=True)
    return result


def compare(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    diffs = [f"{fam}.{key}: {a.get(fam, {}).get(key)} -> {b.get(fam, {}).get(key)}"
             for fam in sorted(set(a) | set(b)) for key in sorted(set(a.get(fam, {})) | set(b.get(fam, {})))
             if a.get(fam, {}).get(key) != b.get(fam, {}).get(key)]
    n = sum(len(v) for v in a.values())
    print("\n".join(diffs) if diffs else f"identical: {n} fingerprints over {len(a)} families")
    return 1 if diffs else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the fingerprints here (JSON)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    import logging

    logging.basicConfig(level=logging.WARNING)
    torch.use_deterministic_algorithms(True)
    with tempfile.TemporaryDirectory() as tmp:
        result = fingerprint(Path(tmp))
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
