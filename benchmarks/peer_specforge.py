"""SpecForge's EAGLE-3 or DFlash recipe on OUR data and budget, measured by OUR evaluator (issues #14, #36).

Trains sgl-project/SpecForge's EAGLE-3 draft (PyPI ``specforge==0.2.0``, its ``specforge train`` entry point:
its ``LlamaForCausalLMEagle3`` draft, ``OnlineEagle3Model`` TTT rollout + loss, offline feature reader/collator,
``BF16Optimizer`` AdamW + warmup/cosine schedule, checkpointing) on a finished pipeline run's prepared samples and
a FULL-layout extraction of the same samples (fp32 aux states + the verifier's last hidden state), exports the draft
with ``specforge export --to sglang`` and measures held-out τ with our evaluator on the built-in prompts.

    # the same prepared samples, extracted in the full layout (fp32 aux states + the last hidden state)
    tiny-speculators extract --data runs/smollm2-135m/prepare --out runs/smollm2-135m/extract-full --layout full
    python benchmarks/peer_specforge.py --run runs/smollm2-135m \
        --hidden-states runs/smollm2-135m/extract-full --epochs 15 --work runs/peers/specforge
    # DFlash (issue #36): SpecForge's DFlash trainer at our DFlash draft's shape (2 layers, block 4) on the DFlash
    # config's data and aux layers (2, 9, 15, 21, 28); its recipe otherwise (batch 1, AdamW 1e-4 cosine, CE on the
    # data's tokens, up to 512 anchors per sample, the verifier's full-vocabulary head)
    tiny-speculators extract --data runs/smollm2-135m-dflash/prepare --out runs/smollm2-135m-dflash/extract-full \
        --layout full --layers 2 9 15 21 28
    python benchmarks/peer_specforge.py --family dflash --run runs/smollm2-135m-dflash \
        --hidden-states runs/smollm2-135m-dflash/extract-full --epochs 3 --work runs/peers/specforge-dflash
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

DFlash (``--family dflash``): the features are ``input_ids``, ``loss_mask`` and ``hidden_states`` (our five aux
states, concatenated); the draft config is SpecForge's ``DFlashDraftModel`` (Qwen3 layers, full attention, block
``--block-size``, ``dflash_config.target_layer_ids`` = our aux ids - 1, our mask token: the verifier's pad token);
SpecForge's DFlash has no draft vocabulary, so it keeps the verifier's full-vocabulary head (ours: ``vocab/``'s
4096 tokens). SpecForge has no P-EAGLE offline path: its P-EAGLE takes features only streamed from an SGLang server
(``FeatureMode.STREAMING``, flex attention only), which this CPU machine cannot run. The draft is exported with
``specforge export --to hf`` (fp32, as trained) and rewritten in the speculators DFlash format (the same tensors; its
``target_layer_ids`` + 1 as ``aux_hidden_state_layer_ids``; bidirectional blocks), which our importer reads; a parity
check first pins that our import computes SpecForge's own training forward (every slot of blocks at fixed anchors
on a stored sample), then our evaluator judges it (its DFlash counters equal vLLM's).

The EAGLE-3 draft evaluated is what ``specforge export --to sglang`` writes: ``config.json`` + ``model.safetensors`` in
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
                     seed: int, family: str = "eagle3") -> dict:
    """Our full-layout shards -> one SpecForge offline feature file per TRAINING sample (``data_*.ckpt``).

    EAGLE-3: a file holds ``input_ids`` (T,), ``loss_mask`` (T,), ``aux_hidden_state`` (1, T, 3H) and
    ``hidden_state`` (1, T, H) = the final RMSNorm of our pre-norm ``last_hidden_state`` (so
    ``lm_head(hidden_state)`` are the verifier's logits, which is what SpecForge's ``TargetHead`` computes).
    DFlash: ``input_ids``, ``loss_mask`` and ``hidden_states`` (T, n_aux*H), the aux states in our layer order
    (its ``target_layer_ids`` are ours - 1: the layer whose output is captured); it trains on the data's tokens."""
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
        # clone: the reader's rows are views of a memory-mapped shard and torch.save writes a view's whole storage
        record = {"input_ids": s["input_ids"].clone(), "loss_mask": s["loss_mask"].clone()}
        if family == "dflash":
            record["hidden_states"] = s["aux_hidden_states"].float().clone()  # (T, n_aux*H)
        else:
            last = s["last_hidden_state"].float()  # (T, H) pre-norm
            normed = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + eps) * norm_w  # LlamaRMSNorm, fp32
            record["aux_hidden_state"] = s["aux_hidden_states"].float().unsqueeze(0).clone()  # (1, T, 3H)
            record["hidden_state"] = normed.unsqueeze(0).clone()  # (1, T, H)
        torch.save(record, out / f"data_{n:05d}.ckpt")
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


def dflash_draft_config(verifier_dir: Path, num_layers: int, block_size: int, aux_layer_ids: list[int],
                        mask_token_id: int) -> dict:
    """SpecForge's ``DFlashDraftModel`` config (a Qwen3 decoder stack of the verifier's shape, full attention, its
    hidden states taken from our aux layers): our DFlash draft's shape."""
    v = json.loads((verifier_dir / "config.json").read_text())
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "hidden_act", "max_position_embeddings", "rms_norm_eps", "vocab_size", "bos_token_id", "eos_token_id",
            "pad_token_id", "rope_parameters")
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **{k: v[k] for k in keys if k in v},
            "num_hidden_layers": num_layers, "num_target_layers": int(v["num_hidden_layers"]),
            "block_size": block_size, "layer_types": ["full_attention"] * num_layers, "sliding_window": None,
            "use_sliding_window": False, "attention_bias": False, "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "dflash_config": {"target_layer_ids": [i - 1 for i in aux_layer_ids], "mask_token_id": mask_token_id}}


def run_config(*, target: Path, draft_cfg: Path, vocab: Path | None, features: Path, out: Path, epochs: int,
               max_steps: int | None, ttt_length: int, seed: int, lr: float | None, family: str = "eagle3",
               mask_token_id: int | None = None) -> dict:
    """SpecForge's typed run config: its defaults except what the docstring lists."""
    training = {"strategy": family, "num_epochs": epochs, "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD",
                "seed": seed, "log_interval": 20, "save_interval": 0}
    if family == "eagle3":
        training["ttt_length"] = ttt_length
    if max_steps:
        training["max_steps"] = max_steps
    if lr:
        training["learning_rate"] = lr
    model = {"target_model_path": str(target), "draft_model_config": str(draft_cfg),
             "lm_head_key": "model.embed_tokens.weight", "embedding_key": "model.embed_tokens.weight",
             "torch_dtype": "float32"}
    if vocab is not None:
        model["vocab_mapping_path"] = str(vocab)
    if mask_token_id is not None:
        model["mask_token_id"] = mask_token_id
    return {"run_id": "peer-specforge", "output_dir": str(out), "model": model,
            "data": {"hidden_states_path": str(features), "dataloader_num_workers": 0}, "training": training}


def dflash_to_speculators(hf: Path, out: Path, verifier: str, verifier_dir: Path) -> Path:
    """SpecForge's HF DFlash export -> the speculators DFlash format our importer (and vLLM) reads, its config written
    by our own exporter's: the same tensors (``fc``, ``hidden_norm``, ``layers.*``, ``norm``; no head: the
    verifier's lm_head, as SpecForge trains it), ``aux_hidden_state_layer_ids`` = its ``target_layer_ids`` + 1,
    bidirectional blocks."""
    from safetensors.torch import load_file, save_file

    from tiny_speculators.models.dflash.speculators import config as speculators_config
    from tiny_speculators.models.family import ExportInfo

    cfg = json.loads((hf / "config.json").read_text())
    if any(t != "full_attention" for t in cfg.get("layer_types") or []):
        raise SystemExit(f"{hf}: sliding-window layers; the harness converts full-attention DFlash drafts only")
    dflash, block = cfg["dflash_config"], int(cfg["block_size"])
    kwargs = {**{k: cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                                     "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                                     "max_position_embeddings", "rope_parameters")},
              "num_layers": int(cfg["num_hidden_layers"]), "draft_vocab_size": int(cfg["vocab_size"]),
              "block_size": block, "mask_token_id": int(dflash["mask_token_id"]), "causal": False,
              "aux_layer_ids": [int(i) + 1 for i in dflash["target_layer_ids"]]}
    architectures = json.loads((verifier_dir / "config.json").read_text()).get("architectures", [])
    info = ExportInfo(verifier_name=verifier, verifier_architectures=architectures, speculative_tokens=block - 1,
                      dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(speculators_config(kwargs, info), indent=1))
    state = load_file(str(hf / "model.safetensors"))
    save_file({k: t.float().contiguous() for k, t in state.items() if not k.startswith("embed_tokens")},
              str(out / "model.safetensors"))
    return out


def check_dflash_parity(python: Path, hf: Path, converted: Path, feature: Path, out: Path, threads: int) -> dict:
    """SpecForge's own DFlash training forward (fixed anchors) against our import of the converted draft, every
    slot of every block: the logits must agree, or our evaluator would judge another function."""
    from peer_speculators import block_logits  # the same comparison the speculators harness makes
    from safetensors.torch import load_file

    from tiny_speculators.models.importing import import_draft
    from tiny_speculators.verifier.load import resolve_verifier

    weights = Path(resolve_verifier(VERIFIER)) / "model.safetensors"
    run_peer(python, ["dflash-parity", str(hf), str(feature), str(weights), str(out)], out.with_suffix(".log"),
             threads)
    peer = load_file(str(out))
    ours, _ = import_draft(converted, verifier=VERIFIER)
    ours.eval()
    with torch.no_grad():
        logits, _ = block_logits(ours, peer)
    diff = float((logits - peer["logits"]).abs().max())
    agree = float((logits.argmax(-1) == peer["logits"].argmax(-1)).float().mean())
    if diff > 1e-3 * max(1.0, float(peer["logits"].abs().max())) or agree < 1.0:
        raise SystemExit(f"our import of {converted} does not compute SpecForge's DFlash forward: max |logit diff| "
                         f"{diff:.3g}, argmax agreement {agree:.3f}")
    return {"slots": int(logits.shape[0]), "max_abs_logit_diff": diff, "argmax_agreement": agree}


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
    ap.add_argument("--family", choices=("eagle3", "dflash"), default="eagle3")
    ap.add_argument("--run", type=Path, required=True, help="finished pipeline run (its vocab/ is used)")
    ap.add_argument("--hidden-states", type=Path, required=True, help="FULL-layout extraction of the run's data")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--max-steps", type=int, default=None, help="stop early (smoke runs)")
    ap.add_argument("--ttt-length", type=int, default=3, help="EAGLE-3")
    ap.add_argument("--num-layers", type=int, default=2, help="DFlash draft layers (our DFlash config's)")
    ap.add_argument("--block-size", type=int, default=4, help="DFlash block (our DFlash config's)")
    ap.add_argument("--mask-token-id", type=int, default=None,
                    help="DFlash; default: our DFlash's (the verifier's pad token, else its eos)")
    ap.add_argument("--lr", type=float, default=None, help="override SpecForge's default 1e-4")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-fraction", type=float, default=0.05, help="our train stage's held-out share")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    ap.add_argument("--fp32-export", action="store_true",
                    help="EAGLE-3: also evaluate the checkpoint exported in fp32 (SpecForge's export writes bf16)")
    a = ap.parse_args()
    from safetensors.torch import load_file

    from tiny_speculators.evaluate.stage import evaluate
    from tiny_speculators.verifier.load import resolve_verifier

    python = ensure_venv(a.venv)
    a.work.mkdir(parents=True, exist_ok=True)
    verifier_dir = Path(resolve_verifier(VERIFIER))
    target = target_view(verifier_dir, a.work / "target")
    stats = convert_features(a.hidden_states, verifier_dir, a.work / "features", eval_fraction=a.eval_fraction,
                             seed=a.seed, family=a.family)
    if a.family == "dflash" and a.mask_token_id is None:
        from types import SimpleNamespace

        from tiny_speculators.models.family import mask_token_of

        a.mask_token_id = mask_token_of(None, SimpleNamespace(**json.loads((verifier_dir / "config.json").read_text())))
    if a.family == "dflash":  # full vocabulary: SpecForge's DFlash has no draft vocabulary (it trains with the
        # verifier's lm_head), so ours is not passed
        vocab_path = None
        dcfg = dflash_draft_config(verifier_dir, a.num_layers, a.block_size, stats["aux_layer_ids"],
                                   a.mask_token_id)
    else:
        vocab = load_file(str(a.run / "vocab" / "vocab.safetensors"))  # d2t (D,), t2d (V,): SpecForge's layout
        vocab_path = a.work / "vocab_mapping.pt"
        torch.save({"d2t": vocab["d2t"], "t2d": vocab["t2d"]}, vocab_path)
        dcfg = draft_config(verifier_dir, int(vocab["d2t"].numel()), stats["aux_layer_ids"])
    (a.work / "draft_config.json").write_text(json.dumps(dcfg, indent=1))
    rcfg = run_config(target=target, draft_cfg=a.work / "draft_config.json", vocab=vocab_path,
                      features=a.work / "features", out=a.work / "output", epochs=a.epochs, max_steps=a.max_steps,
                      ttt_length=a.ttt_length, seed=a.seed, lr=a.lr, family=a.family,
                      mask_token_id=a.mask_token_id if a.family == "dflash" else None)
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

    def evaluate_once(draft: Path, name: str) -> dict:
        out = a.work / f"eval-{name}-k{a.k}"
        if (out / "summary.json").is_file():
            return json.loads((out / "summary.json").read_text())
        return evaluate(VERIFIER, draft, out, prompts="builtin", k=a.k, max_new_tokens=a.max_new_tokens,
                        max_prompts=a.max_prompts, seed=a.seed)

    def export(name: str, to: str, *extra: str) -> Path:
        if not (a.work / name / "config.json").is_file():
            run_peer(python, ["export", "--to", to, "--checkpoint", str(a.work / "output"), "--draft-config",
                              str(a.work / "draft_config.json"), "--output-dir", str(a.work / name), *extra],
                     a.work / "export.log", a.threads)
        return a.work / name

    parity = ev32 = None
    if a.family == "dflash":
        hf = export("draft-hf", "hf")  # fp32, as trained (its HF export keeps the checkpoint's dtype)
        draft = dflash_to_speculators(hf, a.work / "draft", VERIFIER, verifier_dir)
        parity = check_dflash_parity(python, hf, draft, a.work / "features" / "data_00000.ckpt",
                                     a.work / "parity.safetensors", a.threads)
        ev = evaluate_once(draft, "draft")
        draft_dtype = "float32 (specforge export --to hf, converted to the speculators DFlash format)"
    else:
        draft = export("draft", "sglang")
        ev = evaluate_once(draft, "draft")
        # the same checkpoint without SpecForge's bf16 rounding of the exported weights
        ev32 = evaluate_once(export("draft-fp32", "sglang", "--fp32-export"), "draft-fp32") if a.fp32_export else None
        draft_dtype = "bfloat16 (specforge export --to sglang)"
    report = train_report(a.work / "output", a.work / "train.log")
    steps = report["optimizer_steps"]
    defaults = {"batch_size": 1, "learning_rate": a.lr or 1e-4, "lr_scheduler": "cosine", "warmup_ratio": 0.015,
                "max_grad_norm": 0.5, "optimizer": "AdamW (BF16Optimizer: fp32 masters, weight_decay 0)",
                "max_length": 2048}
    if a.family == "dflash":
        defaults.update(num_anchors=512, loss="cross-entropy on the data's next tokens (loss_type dflash, no decay)",
                        head="the verifier's lm_head, full vocabulary", block_size=a.block_size,
                        num_layers=a.num_layers)
    else:
        defaults["loss"] = ("forward KL to the verifier's distribution renormalized on the draft vocab, per TTT step "
                            "weighted 0.8**i, positions where the verifier's argmax is outside the draft vocab masked")
    result = {"peer": SPECFORGE, "family": a.family, "venv_pins": [TORCH, SPECFORGE, *PINS],
              "acceptance_length": ev["acceptance_length"],
              "per_position_acceptance": ev["per_position_acceptance"], "matches_baseline": ev["matches_baseline"],
              "k": a.k, "max_prompts": a.max_prompts, "max_new_tokens": a.max_new_tokens,
              "epochs": a.epochs, "optimizer_steps": steps, "samples_per_step": 1, "train_samples": stats["samples"],
              "tokens_per_epoch": stats["tokens"], "loss_tokens_per_epoch": stats["loss_tokens"],
              "tokens_seen": stats["tokens"] * a.epochs if not a.max_steps else None,
              "train_seconds": round(train_s, 1), "last_logged_train_metrics": report["last_logged"],
              "recipe": {**rcfg["training"], "specforge_defaults_kept": defaults},
              "model": rcfg["model"], "draft": str(draft), "draft_dtype": draft_dtype,
              "parity_with_specforge_forward": parity,
              "fp32_export": None if ev32 is None else {
                  key: ev32[key] for key in ("acceptance_length", "per_position_acceptance", "matches_baseline")}}
    (a.work / "results.json").write_text(json.dumps(result, indent=2))
    print(f"SpecForge {SPECFORGE.split('==')[1]} {a.family}: τ {ev['acceptance_length']:.3f} at k={a.k} (per "
          f"position {' / '.join(f'{p:.3f}' for p in ev['per_position_acceptance'])}), {a.epochs} epochs = {steps} "
          f"steps over {stats['samples']} samples, train {train_s:.0f} s, lossless {ev['matches_baseline']}")


if __name__ == "__main__":
    main()
