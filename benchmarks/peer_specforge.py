"""SpecForge's EAGLE-3 recipe on OUR data and budget, measured by OUR evaluator (issue #14, side-by-side harness).

Trains sgl-project/SpecForge's EAGLE-3 draft (PyPI ``specforge==0.2.0``, its ``specforge train`` entry point:
its ``LlamaForCausalLMEagle3`` draft, ``OnlineEagle3Model`` TTT rollout + loss, offline feature reader/collator,
``BF16Optimizer`` AdamW + warmup/cosine schedule, checkpointing) on a finished pipeline run's prepared samples and
a FULL-layout extraction of the same samples (fp32 aux states + the verifier's last hidden state), exports the draft
with ``specforge export --to sglang`` and measures held-out τ with our evaluator on the built-in prompts.

    # the same prepared samples, extracted in the full layout (fp32 aux states + the last hidden state)
    tiny-speculators extract --data runs/smollm2-135m/prepare --out runs/smollm2-135m/extract-full --layout full
    python benchmarks/peer_specforge.py --run runs/smollm2-135m \
        --hidden-states runs/smollm2-135m/extract-full --epochs 15 --work runs/peers/specforge
    # tiny smoke run (a few optimizer steps, one short prompt)
    python benchmarks/peer_specforge.py --run runs/smollm2-135m \
        --hidden-states runs/smollm2-135m/extract-full --epochs 1 --max-steps 4 --max-prompts 1 \
        --max-new-tokens 16 --work runs/peers/specforge-smoke

The peer runs in its own virtual environment (``--venv``, built on first use from :data:`PINS`): torch 2.13.0 (the
local CPU build), ``specforge==0.2.0`` with ``--no-deps`` (it pins torch 2.11 / sglang / CUDA wheels, none of
which this CPU-only path imports) and the few libraries its training modules import, at our project's versions.

What the peer gets from us, so only the recipe differs: the same training samples (our seeded 5% validation split
removed, the same tokens and loss masks), the same hidden states (our aux layers 2/15/27 = SGLang ids 1/14/26,
written into each sample's ``aux_hidden_state``; the verifier's final hidden state after its final RMSNorm as
``hidden_state``, since SpecForge's ``TargetHead`` is the lm_head alone), our 4096-token draft vocabulary
(``vocab/`` d2t/t2d passed as ``model.vocab_mapping_path``; SpecForge would otherwise build one from the same
loss-masked tokens) and the same draft shape (one Llama layer of the verifier's width). Everything else is
SpecForge's ``TrainingConfig`` default (see :func:`run_config`): batch 1 sample per step, AdamW lr 1e-4, warmup
1.5% then cosine, grad-norm clip 0.5, forward-KL (``LogSoftmaxLoss``) per TTT step weighted 0.8**i, max length
2048; except ``ttt_length`` 3 (its default is 7; ours is 3), fp32 (``torch_dtype``; its default bf16), ``sdpa``
attention (its default flex_attention needs a compiled GPU kernel) and seed 0 (its default 42).

CPU patches: ``SPECFORGE_DEVICE=cpu`` (SpecForge's own device switch: a 1-process gloo group),
``TORCHDYNAMO_DISABLE=1`` (its ``@torch.compile`` helpers run eagerly: same math, no inductor build on 2 cores),
``training.fsdp_sharding: NO_SHARD`` (a config value: DDP instead of FSDP, which refuses CPU; one rank either way)
and, in ``benchmarks/peer_specforge_driver.py`` (runs inside the peer venv), two code patches: its triton KL
kernel replaced by the reference ``_compute_loss`` of the same file, and ``TargetHead`` kept in fp32
(``from_pretrained`` hard-codes bf16). The verifier is shown to SpecForge through a folder of symlinks plus a
``model.safetensors.index.json`` (``TargetHead`` insists on an index) and ``lm_head_key`` = the tied embedding.

The draft evaluated is what ``specforge export --to sglang`` writes: ``config.json`` + ``model.safetensors`` in
bfloat16 (its exporter hard-codes bf16; our importer fills the embeddings from the verifier). ``--fp32-export``
also evaluates the same checkpoint exported in fp32. A finished training or evaluation in ``--work`` is reused.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

SPECFORGE = "specforge==0.2.0"
TORCH = "torch==2.13.0"
# what SpecForge's training modules import, at the versions our project venv uses (its own pins are torch 2.11 /
# transformers 5.8.1 for CUDA: we keep torch 2.13.0 CPU and match transformers to ours)
PINS = ["transformers==5.24.0", "tokenizers==0.23.3", "safetensors==0.8.0", "datasets==5.2.0",
        "accelerate==1.15.0", "huggingface_hub==2.4.0", "pydantic==2.14.4", "numpy==2.4.6", "psutil==7.2.2",
        "pyyaml", "tqdm", "requests", "typing-extensions"]
DEFAULT_VENV = Path("~/.cache/tiny-speculators/peers/specforge-venv").expanduser()
DRIVER = Path(__file__).with_name("peer_specforge_driver.py")
VERIFIER = "smollm2-135m"


def ensure_venv(venv: Path) -> Path:
    """The peer's python, building its venv once (a marker file records what was installed)."""
    python = venv / "bin" / "python"
    marker = venv / "tiny-speculators-pins.json"
    wanted = {"torch": TORCH, "specforge": SPECFORGE, "pins": PINS}
    if python.is_file() and marker.is_file() and json.loads(marker.read_text()) == wanted:
        return python
    print(f"building the SpecForge venv in {venv} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH], check=True)  # first, so nothing below can pull another torch
    subprocess.run([*pip, "--no-deps", SPECFORGE], check=True)
    subprocess.run([*pip, *PINS], check=True)
    out = subprocess.run([str(python), "-c", "import torch, specforge.cli; print(torch.__version__)"],
                         check=True, capture_output=True, text=True).stdout.strip()
    if not out.startswith("2.13.0"):
        raise SystemExit(f"the peer venv has torch {out}, expected 2.13.0")
    marker.write_text(json.dumps(wanted, indent=1))
    return python


def target_view(verifier_dir: Path, out: Path) -> Path:
    """The verifier folder as SpecForge's loaders want it: symlinks plus a safetensors index."""
    from safetensors import safe_open

    out.mkdir(parents=True, exist_ok=True)
    for f in verifier_dir.iterdir():
        link = out / f.name
        if not link.exists():
            link.symlink_to(f.resolve())
    with safe_open(str(verifier_dir / "model.safetensors"), framework="pt") as f:
        weight_map = {k: "model.safetensors" for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def convert_features(hidden_states: Path, verifier_dir: Path, out: Path, *, eval_fraction: float,
                     seed: int) -> dict:
    """Our full-layout shards -> one SpecForge offline feature file per TRAINING sample (``data_*.ckpt``).

    A file holds ``input_ids`` (T,), ``loss_mask`` (T,), ``aux_hidden_state`` (1, T, 3H) and ``hidden_state``
    (1, T, H) = the final RMSNorm of our pre-norm ``last_hidden_state`` (so ``lm_head(hidden_state)`` are the
    verifier's logits, which is what SpecForge's ``TargetHead`` computes)."""
    from safetensors import safe_open

    from tiny_speculators.storage.reader import HiddenStateReader
    from tiny_speculators.train.data import prompt_keys, split_train_val

    reader = HiddenStateReader(hidden_states)
    if reader.layout.name != "full":
        raise SystemExit(f"{hidden_states} has layout {reader.layout.name}; SpecForge needs the full layout")
    # the split our train stage makes (each prompt on one side)
    train_idx, val_idx = split_train_val(len(reader), eval_fraction, seed,
                                         groups=prompt_keys(reader.token_columns()))
    stats = {"samples": len(train_idx), "held_out": len(val_idx), "tokens": 0, "loss_tokens": 0,
             "aux_layer_ids": reader.manifest["aux_layer_ids"]}
    done = out / "converted.json"
    if done.is_file():
        return json.loads(done.read_text())
    cfg = json.loads((verifier_dir / "config.json").read_text())
    with safe_open(str(verifier_dir / "model.safetensors"), framework="pt") as f:
        norm_w = f.get_tensor("model.norm.weight").float()  # (H,)
    eps = float(cfg["rms_norm_eps"])
    out.mkdir(parents=True, exist_ok=True)
    for n, i in enumerate(train_idx):
        s = reader[i]
        last = s["last_hidden_state"].float()  # (T, H) pre-norm
        normed = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + eps) * norm_w  # LlamaRMSNorm in fp32
        # clone: the reader's rows are views of a memory-mapped shard and torch.save writes a view's whole storage
        torch.save({"input_ids": s["input_ids"].clone(), "loss_mask": s["loss_mask"].clone(),
                    "aux_hidden_state": s["aux_hidden_states"].float().unsqueeze(0).clone(),  # (1, T, 3H)
                    "hidden_state": normed.unsqueeze(0).clone()},  # (1, T, H)
                   out / f"data_{n:05d}.ckpt")
        stats["tokens"] += int(s["input_ids"].numel())
        stats["loss_tokens"] += int(s["loss_mask"].sum())
    done.write_text(json.dumps(stats, indent=1))
    return stats


def draft_config(verifier_dir: Path, draft_vocab_size: int, aux_layer_ids: list[int]) -> dict:
    """SpecForge's ``LlamaForCausalLMEagle3`` config: one decoder layer of the verifier's shape (our draft's)."""
    v = json.loads((verifier_dir / "config.json").read_text())
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "hidden_act", "max_position_embeddings", "rms_norm_eps", "vocab_size", "bos_token_id", "eos_token_id",
            "pad_token_id", "rope_parameters")
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            **{k: v[k] for k in keys if k in v}, "draft_vocab_size": draft_vocab_size,
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
            # SGLang's convention: id = the layer whose OUTPUT is captured = our id - 1
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux_layer_ids]}}


def run_config(*, target: Path, draft_cfg: Path, vocab: Path, features: Path, out: Path, epochs: int,
               max_steps: int | None, ttt_length: int, seed: int, lr: float | None) -> dict:
    """SpecForge's typed run config: its defaults except what the docstring lists."""
    training = {"strategy": "eagle3", "num_epochs": epochs, "ttt_length": ttt_length,
                "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD", "seed": seed, "log_interval": 20,
                "save_interval": 0}
    if max_steps:
        training["max_steps"] = max_steps
    if lr:
        training["learning_rate"] = lr
    return {"run_id": "peer-specforge", "output_dir": str(out),
            "model": {"target_model_path": str(target), "draft_model_config": str(draft_cfg),
                      "vocab_mapping_path": str(vocab), "lm_head_key": "model.embed_tokens.weight",
                      "embedding_key": "model.embed_tokens.weight", "torch_dtype": "float32"},
            "data": {"hidden_states_path": str(features), "dataloader_num_workers": 0},
            "training": training}


def run_peer(python: Path, args: list[str], log: Path, threads: int) -> None:
    env = {**os.environ, "SPECFORGE_DEVICE": "cpu", "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": ""}
    with log.open("a") as f:
        rc = subprocess.run([str(python), str(DRIVER), *args], stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc:
        raise SystemExit(f"SpecForge {args[0]} failed (rc {rc}); see {log}")


def train_report(out: Path, log: Path) -> dict:
    """The optimizer steps SpecForge ran (its checkpoint folder's name) and the last metrics line it printed."""
    steps = [int(p.name.rsplit("step", 1)[1]) for p in out.glob("peer-specforge-step*")]
    last = {}
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("step ") and ": {" in line:
            last = {"step": int(line.split(":")[0].split()[1]), **ast.literal_eval(line.split(": ", 1)[1])}
    return {"optimizer_steps": max(steps) if steps else None, "last_logged": last}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, required=True, help="finished pipeline run (its vocab/ is used)")
    ap.add_argument("--hidden-states", type=Path, required=True, help="FULL-layout extraction of the run's data")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--max-steps", type=int, default=None, help="stop early (smoke runs)")
    ap.add_argument("--ttt-length", type=int, default=3)
    ap.add_argument("--lr", type=float, default=None, help="override SpecForge's default 1e-4")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-fraction", type=float, default=0.05, help="our train stage's held-out share")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    ap.add_argument("--fp32-export", action="store_true",
                    help="also evaluate the checkpoint exported in fp32 (SpecForge's export writes bf16)")
    a = ap.parse_args()
    from safetensors.torch import load_file

    from tiny_speculators.evaluate.stage import evaluate
    from tiny_speculators.verifier.load import resolve_verifier

    python = ensure_venv(a.venv)
    a.work.mkdir(parents=True, exist_ok=True)
    verifier_dir = Path(resolve_verifier(VERIFIER))
    target = target_view(verifier_dir, a.work / "target")
    stats = convert_features(a.hidden_states, verifier_dir, a.work / "features", eval_fraction=a.eval_fraction,
                             seed=a.seed)
    vocab = load_file(str(a.run / "vocab" / "vocab.safetensors"))  # d2t (D,), t2d (V,): SpecForge's own layout
    torch.save({"d2t": vocab["d2t"], "t2d": vocab["t2d"]}, a.work / "vocab_mapping.pt")
    dcfg = draft_config(verifier_dir, int(vocab["d2t"].numel()), stats["aux_layer_ids"])
    (a.work / "draft_config.json").write_text(json.dumps(dcfg, indent=1))
    rcfg = run_config(target=target, draft_cfg=a.work / "draft_config.json", vocab=a.work / "vocab_mapping.pt",
                      features=a.work / "features", out=a.work / "output", epochs=a.epochs, max_steps=a.max_steps,
                      ttt_length=a.ttt_length, seed=a.seed, lr=a.lr)
    (a.work / "run.yaml").write_text(yaml.safe_dump(rcfg))

    # a finished training of this exact config (its final checkpoint and timing on disk) is reused, and so is a
    # finished evaluation: an interrupted benchmark, or one rerun with --fp32-export, only does what is missing
    final = a.work / "output" / f"peer-specforge-step{a.max_steps or stats['samples'] * a.epochs}"
    timing = a.work / "train_seconds.json"
    if not (final.is_dir() and timing.is_file()
            and json.loads(timing.read_text())["config"] == (a.work / "run.yaml").read_text()):
        t0 = time.perf_counter()
        run_peer(python, ["train", "--config", str(a.work / "run.yaml")], a.work / "train.log", a.threads)
        timing.write_text(json.dumps({"seconds": time.perf_counter() - t0,
                                      "config": (a.work / "run.yaml").read_text()}))
    train_s = json.loads(timing.read_text())["seconds"]

    def export_and_evaluate(name: str, *extra: str) -> dict:
        if not (a.work / name / "config.json").is_file():
            run_peer(python, ["export", "--to", "sglang", "--checkpoint", str(a.work / "output"), "--draft-config",
                              str(a.work / "draft_config.json"), "--output-dir", str(a.work / name), *extra],
                     a.work / "export.log", a.threads)
        out = a.work / f"eval-{name}-k{a.k}"
        if (out / "summary.json").is_file():
            return json.loads((out / "summary.json").read_text())
        return evaluate(VERIFIER, a.work / name, out, prompts="builtin", k=a.k, max_new_tokens=a.max_new_tokens,
                        max_prompts=a.max_prompts, seed=a.seed)

    draft = a.work / "draft"
    ev = export_and_evaluate("draft")
    # the same checkpoint without SpecForge's bf16 rounding of the exported weights
    ev32 = export_and_evaluate("draft-fp32", "--fp32-export") if a.fp32_export else None
    report = train_report(a.work / "output", a.work / "train.log")
    steps = report["optimizer_steps"]
    result = {"peer": SPECFORGE, "venv_pins": [TORCH, SPECFORGE, *PINS],
              "acceptance_length": ev["acceptance_length"],
              "per_position_acceptance": ev["per_position_acceptance"], "matches_baseline": ev["matches_baseline"],
              "k": a.k, "max_prompts": a.max_prompts, "max_new_tokens": a.max_new_tokens,
              "epochs": a.epochs, "optimizer_steps": steps, "samples_per_step": 1, "train_samples": stats["samples"],
              "tokens_per_epoch": stats["tokens"], "loss_tokens_per_epoch": stats["loss_tokens"],
              "tokens_seen": stats["tokens"] * a.epochs if not a.max_steps else None,
              "train_seconds": round(train_s, 1), "last_logged_train_metrics": report["last_logged"],
              "recipe": {**rcfg["training"], "specforge_defaults_kept": {
                  "batch_size": 1, "learning_rate": a.lr or 1e-4, "lr_scheduler": "cosine", "warmup_ratio": 0.015,
                  "max_grad_norm": 0.5, "optimizer": "AdamW (BF16Optimizer: fp32 masters, weight_decay 0)",
                  "loss": "forward KL to the verifier's distribution renormalized on the draft vocab, per TTT step "
                          "weighted 0.8**i, positions where the verifier's argmax is outside the draft vocab masked",
                  "max_length": 2048}},
              "model": rcfg["model"], "draft": str(draft), "draft_dtype": "bfloat16 (specforge export --to sglang)",
              "fp32_export": None if ev32 is None else {
                  key: ev32[key] for key in ("acceptance_length", "per_position_acceptance", "matches_baseline")}}
    (a.work / "results.json").write_text(json.dumps(result, indent=2))
    print(f"SpecForge {SPECFORGE.split('==')[1]}: τ {ev['acceptance_length']:.3f} at k={a.k} (per position "
          f"{' / '.join(f'{p:.3f}' for p in ev['per_position_acceptance'])}), {a.epochs} epochs = {steps} steps "
          f"over {stats['samples']} samples, train {train_s:.0f} s, lossless {ev['matches_baseline']}")


if __name__ == "__main__":
    main()
