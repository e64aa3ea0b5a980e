"""speculators' EAGLE-3, P-EAGLE, DFlash or DSpark recipe on OUR data and budget, judged by OUR evaluator (#14, #36).

vllm-project/speculators (PyPI ``speculators==0.9.0``) trains its draft with its own trainer and its own
defaults on exactly the tokens, loss masks and fp32 hidden states our run trained on, for the same number of
optimizer steps of the same number of packed tokens; the draft it saves (``save_pretrained``, speculators format)
is then evaluated by ``tiny-speculators evaluate`` on the held-out built-in prompts, like our drafts.

1. Peer environment: ``~/.cache/tiny-speculators/peers/speculators-venv`` (``$TINY_SPECULATORS_SPECULATORS_VENV``),
   built on first use from the pins in :data:`PINS` (torch 2.13.0 CPU first, then everything else ``--no-deps``
   so pip can never swap torch for a CUDA build; torchvision/torchaudio, which speculators lists but its
   EAGLE-3 training never imports, are left out).
2. Data: our ``prepare``d samples and a ``full``-layout extraction of them (fp32 aux states of the draft's layers
   + the verifier's last PRE-norm hidden state, ``extract --layout full``) become speculators' offline layout: a
   ``datasets`` folder (``input_ids``, ``loss_mask``, ``seq_len``) and ``hidden_states/hs_<i>.safetensors``
   (``hidden_states`` [T, 4, H] = the three aux states then the last state, ``token_ids`` [T]). The rows are
   ordered our training samples first, then our validation samples (``split_train_val`` with eval_fraction
   0.05 and ``--seed``), and ``train_data_ratio`` is set so that speculators' contiguous split holds out exactly
   our validation samples. The draft vocabulary is OUR ``vocab/`` (d2t/t2d as .npy), so the comparison isolates
   the recipe.
3. Training: ``benchmarks/peer_speculators_driver.py`` in the peer environment calls ``speculators.train.cli.main``
   with speculators' defaults except: verifier, data paths, aux layers (``--target-layer-ids``), draft vocab,
   ``total_seq_len`` = ``--batch-tokens`` (its packed tokens per step), ``max_steps`` = ``--steps``, seed, fp32
   hidden states, no dataloader workers. CPU patches and the epoch count are described in the driver.
4. Evaluation: a parity check first (speculators' own forward and our import of the saved draft give the same
   logits on a stored sample: the first step for EAGLE-3 and P-EAGLE, every slot of fixed blocks for DFlash and
   DSpark), then ``tiny-speculators evaluate`` of ``<work>/train/draft`` (``--k``, greedy fp32; reused when already
   run with the same settings). speculators' DFlash and DSpark layers are sliding-window by default (window 2048,
   causal inside the block); our importer has no sliding-window DFlash layers, so they are read through a copy
   that declares full attention (``draft-unwindowed``): the same function while no context reaches the window,
   which the harness checks against the longest training and evaluation sequence, and the parity check pins.
5. ``<work>/results.json`` and a one-line summary.

What still differs from our run, by design (speculators' recipe, recorded under ``recipe`` in results.json): its
draft normalizes the fc input and the fed-back state (``norm_before_fc``, ``norm_output``, ``norm_before_residual``
all on); it reads fp32 aux states (ours: fp8) and a KL to the verifier's full distribution renormalized over the
draft vocabulary (ours: its top-64 tokens, renormalized over the draft vocabulary); Muon (2-D matrices) + AdamW,
linear decay to 0 after 1% warmup (ours: AdamW, cosine, min(10, steps/10) warmup steps in benchmarks/recipe.py);
TTT steps weighted equally (ours: 0.8 decay); its loss mask counts the prediction of token t+1 when token t is
supervised (ours: when t+1 is), across packed documents. That paragraph is EAGLE-3's; for P-EAGLE, DFlash and
DSpark the comments of the examples below name speculators' recipe, and ``recipe`` in results.json records it.

    # the same prepared samples, extracted in the full layout (fp32 aux states + the last hidden state)
    tiny-speculators extract --data runs/smollm2-135m/prepare --out runs/smollm2-135m/extract-full --layout full
    python benchmarks/peer_speculators.py --run runs/smollm2-135m \
        --hidden-states runs/smollm2-135m/extract-full --steps 405 --batch-tokens 2048 \
        --work runs/peers/speculators
    # P-EAGLE (issue #36): speculators' P-EAGLE trainer, at our draft's shape (2 layers, 4 depths); its recipe
    # otherwise (trained embeddings, COD 0.7/0.2, up to 512 anchors, Muon, KL to the full distribution). Our
    # evaluator's P-EAGLE counters equal vLLM's (tests/export/test_vllm_peagle.py), so it is the judge here too.
    python benchmarks/peer_speculators.py --family peagle --num-layers 2 --depths 4 --run runs/smollm2-135m-peagle \
        --hidden-states runs/smollm2-135m-peagle/extract-full --steps 108 --batch-tokens 2048 \
        --work runs/peers/speculators-peagle
    # DFlash (issue #36): speculators' DFlash trainer at our draft's shape (2 layers, block 4) on the DFlash
    # config's data and aux layers; its recipe otherwise (D-PACE, CE, up to 512 anchors per packed sequence, Muon)
    tiny-speculators extract --data runs/smollm2-135m-dflash/prepare --out runs/smollm2-135m-dflash/extract-full \
        --layout full --layers 2 9 15 21 28
    python benchmarks/peer_speculators.py --family dflash --run runs/smollm2-135m-dflash \
        --hidden-states runs/smollm2-135m-dflash/extract-full --steps 81 --batch-tokens 2048 \
        --work runs/peers/speculators-dflash
    # DSpark: the same data (its embedded config shares DFlash's), block 4, judged at k = 4 like ours
    python benchmarks/peer_speculators.py --family dspark --run runs/smollm2-135m-dspark \
        --hidden-states runs/smollm2-135m-dflash/extract-full --steps 81 --batch-tokens 2048 --k 4 \
        --work runs/peers/speculators-dspark
    # tiny smoke run
    python benchmarks/peer_speculators.py --run runs/smollm2-135m --hidden-states runs/smollm2-135m/extract-full \
        --steps 4 --max-prompts 1 --max-new-tokens 16 --work runs/peers/speculators-smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "peer_speculators_driver.py"
VENV = Path(os.environ.get("TINY_SPECULATORS_SPECULATORS_VENV",
                           Path.home() / ".cache/tiny-speculators/peers/speculators-venv"))
TORCH = "torch==2.13.0"
PEER = "speculators==0.9.0"
# what speculators 0.9.0's training path imports, at the versions it accepts (transformers <= 5.19.0, datasets
# <= 5.1.0), installed --no-deps
PINS = [PEER, "hs-connectors==0.9.0", "transformers==5.19.0", "datasets==5.1.0", "huggingface_hub==2.4.0",
        "tokenizers==0.23.3", "safetensors==0.8.0", "numpy==2.4.6", "pydantic==2.14.4", "pydantic-settings==2.16.3",
        "loguru==0.7.3", "tqdm==4.70.1", "rich==15.0.0", "typer==0.29.2", "click==8.5.1", "psutil==7.2.2",
        "protobuf==7.36.2", "PyYAML==6.0.4", "openai==3.57.0", "httpx==0.28.1", "aiohttp==3.14.5"]
MARKER = ".tiny-speculators-peer-" + PEER


def ensure_venv() -> Path:
    """The peer environment's python; builds the environment when its marker is missing (~2-4 min)."""
    python = VENV / "bin" / "python"
    if (VENV / MARKER).is_file() and python.is_file():
        return python
    shutil.rmtree(VENV, ignore_errors=True)
    VENV.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    pip = [str(VENV / "bin" / "pip"), "install", "--quiet"]
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([*pip, TORCH], check=True)
    # the dependencies of the pins (resolved with torch pinned, so pip cannot replace the CPU build)
    constraint = VENV / "constraints.txt"
    constraint.write_text(TORCH + "\n")
    subprocess.run([*pip, "-c", str(constraint), *PINS[1:]], check=True)
    subprocess.run([*pip, "--no-deps", PEER], check=True)
    subprocess.run([str(python), "-c", "import torch, speculators.train.cli; assert torch.__version__.startswith("
                    f"'{TORCH.split('==')[1]}'), torch.__version__"], check=True)
    (VENV / MARKER).write_text(f"built in {time.perf_counter() - t0:.0f} s\n")
    return python


def convert(run: Path, hidden_states: Path, out: Path, seed: int, eval_fraction: float) -> dict:
    """Our prepared samples + full-layout shards + vocab -> speculators' offline data folder (skipped when done)."""
    done = out / "conversion.json"
    if done.is_file():
        return json.loads(done.read_text())
    import numpy as np
    import torch
    from datasets import Dataset
    from safetensors.torch import load_file, save_file

    from tiny_speculators.storage.reader import HiddenStateReader
    from tiny_speculators.train.data import prompt_keys, split_train_val

    reader = HiddenStateReader(hidden_states)
    if reader.manifest["layout"] != "full" or reader.manifest.get("dtype") != "float32":
        raise SystemExit(f"{hidden_states} has layout {reader.manifest['layout']} ({reader.manifest.get('dtype')}); "
                         "speculators trains on full fp32 targets: extract with --layout full")
    # the split our train stage makes (each prompt on one side)
    train_idx, val_idx = split_train_val(len(reader), eval_fraction, seed,
                                         groups=prompt_keys(reader.token_columns()))
    shutil.rmtree(out, ignore_errors=True)
    (out / "hidden_states").mkdir(parents=True)
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    tokens = masked = 0
    for row, i in enumerate(train_idx + val_idx):
        s = reader[i]
        ids = s["input_ids"].long()  # (T,)
        n_aux = s["aux_hidden_states"].shape[1] // s["last_hidden_state"].shape[1]
        aux = s["aux_hidden_states"].float().reshape(len(ids), n_aux, -1)  # (T, n_aux, H)
        states = torch.cat([aux, s["last_hidden_state"].float()[:, None]], dim=1).contiguous()  # (T, n_aux+1, H)
        save_file({"hidden_states": states, "token_ids": ids}, str(out / "hidden_states" / f"hs_{row}.safetensors"))
        rows["input_ids"].append(ids.tolist())
        rows["loss_mask"].append(s["loss_mask"].long().tolist())
        rows["seq_len"].append(len(ids))
        tokens += len(ids)
        masked += int(s["loss_mask"].sum())
    ds = Dataset.from_dict(rows)
    ds.set_format(type="torch")
    ds.save_to_disk(str(out / "dataset"))
    vocab = load_file(str(run / "vocab" / "vocab.safetensors"))
    np.save(out / "d2t.npy", vocab["d2t"].long().numpy())
    np.save(out / "t2d.npy", vocab["t2d"].bool().numpy())
    info = {"samples": len(rows["seq_len"]), "train_samples": len(train_idx), "val_samples": len(val_idx),
            "tokens": tokens, "masked_tokens": masked, "aux_layer_ids": reader.manifest["aux_layer_ids"],
            "draft_vocab_size": int(vocab["d2t"].numel()), "split_seed": seed, "eval_fraction": eval_fraction,
            "train_tokens": sum(rows["seq_len"][:len(train_idx)]), "source": str(hidden_states)}
    done.write_text(json.dumps(info, indent=2))
    return info


def train(python: Path, data: Path, info: dict, a) -> dict:
    out = a.work / "train"
    n, n_train = info["samples"], info["train_samples"]
    options = {
        "out": str(out), "verifier": str(a.verifier_dir), "data_path": str(data / "dataset"),
        "hidden_states_path": str(data / "hidden_states"),
        "d2t_path": str(data / "d2t.npy"), "t2d_path": str(data / "t2d.npy"),
        "draft_vocab_size": info["draft_vocab_size"], "target_layer_ids": info["aux_layer_ids"],
        "total_seq_len": a.batch_tokens, "max_steps": a.steps, "seed": a.seed, "threads": a.threads,
        "train_data_ratio": (n_train + 0.5) / n,  # int(n * ratio) == n_train: our validation samples held out
        "speculator_type": a.family, "overrides": overrides(a),
    }
    done = out / "driver_summary.json"
    if done.is_file() and (out / "draft" / "config.json").is_file() and \
            json.loads((out / "options.json").read_text()) == options:
        return json.loads(done.read_text())  # trained already with these options: evaluate again
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "options.json").write_text(json.dumps(options, indent=2))
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": ""}
    with (out / "train.log").open("w") as log:
        rc = subprocess.run([str(python), str(DRIVER), str(out / "options.json")], stdout=log,
                            stderr=subprocess.STDOUT, env=env).returncode
    if rc:
        raise SystemExit(f"speculators training failed (rc {rc}); see {out / 'train.log'}")
    return json.loads((out / "driver_summary.json").read_text())


def overrides(a) -> dict:
    """speculators' TrainConfig fields set beside the data and budget: the family's shape, then ``--overrides``."""
    block = {"num_layers": a.num_layers, "block_size": a.block_size}
    shape = {"eagle3": {}, "peagle": {"num_layers": a.num_layers, "num_depths": a.depths}, "dflash": block,
             "dspark": block}[a.family]
    return {**shape, **json.loads(a.overrides)}


def unwindowed(draft: Path, longest: int) -> Path:
    """A DFlash/DSpark draft whose layers are sliding-window (speculators' default: window 2048, causal inside the
    block), as a copy that declares full attention, for our importer, which refuses sliding-window DFlash layers.
    The same function wherever no context reaches the window: checked against ``longest``, the longest sequence
    trained or evaluated, and pinned by :func:`check_parity`. ``draft`` itself when it has no sliding layers."""
    cfg = json.loads((draft / "config.json").read_text())
    layer = cfg["transformer_layer_config"]
    if "sliding_attention" not in (layer.get("layer_types") or []):
        return draft
    if layer["sliding_window"] < longest:
        raise SystemExit(f"{draft}: sliding window {layer['sliding_window']} < {longest} tokens, where it binds: "
                         "our importer has no sliding-window DFlash layers")
    out = draft.parent / "draft-unwindowed"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(draft, out)
    layer.update(layer_types=["full_attention"] * len(layer["layer_types"]), use_sliding_window=False)
    # vLLM 0.32 and our importer read block causality from sliding_window_non_causal (false here: causal)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def check_parity(python: Path, draft: Path, data: Path, work: Path, verifier: str, tokens: int = 128,
                 ours_draft: Path | None = None) -> dict:
    """Speculators' forward and our importer's draft on the same stored sample: the logits must agree (EAGLE-3 and
    P-EAGLE: the first step; DFlash, DSpark: every slot of blocks at fixed anchors), or our evaluator would measure a
    different function from the one speculators trained."""
    import torch
    from safetensors.torch import load_file

    from tiny_speculators.models.importing import import_draft

    out = work / "parity.safetensors"
    subprocess.run([str(python), str(DRIVER), "parity", str(draft), str(data / "hidden_states" / "hs_0.safetensors"),
                    str(tokens), str(out)], check=True, env={**os.environ, "PYTHONPATH": ""},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peer = load_file(str(out))
    ours, _ = import_draft(ours_draft or draft, verifier=verifier)
    ours.eval()
    with torch.no_grad():
        if "anchors" in peer:  # DFlash, DSpark
            logits, confidence = block_logits(ours, peer)
            if "confidence" in peer and (confidence is None or
                                         float((confidence - peer["confidence"]).abs().max()) > 1e-3):
                raise SystemExit(f"our import of {draft} does not compute speculators' DSpark confidence head")
        else:
            logits = ours(peer["input_ids"][None].long(), ours.fuse(peer["aux"][None]),
                          peer["position_ids"][None].long()).logits[0].float()  # (T-1, Vd)
    diff = float((logits - peer["logits"]).abs().max())
    agree = float((logits.argmax(-1) == peer["logits"].argmax(-1)).float().mean())
    if diff > 1e-3 * max(1.0, float(peer["logits"].abs().max())) or agree < 1.0:
        raise SystemExit(f"our import of {draft} does not compute speculators' forward: max |logit diff| {diff:.3g}, "
                         f"argmax agreement {agree:.3f}")
    result = {"positions": int(logits.shape[0]), "max_abs_logit_diff": diff, "argmax_agreement": agree}
    if "mask_hidden" in peer:  # P-EAGLE: the mask slots' inputs (the forward above is its depth-0 slots)
        if int(peer["mask_token_id"]) != ours.mask_token_id or not torch.equal(
                ours.mask_hidden.reshape(-1).float(), peer["mask_hidden"]):
            raise SystemExit(f"our import of {draft} does not read speculators' mask token id or mask hidden state")
        result["mask_token_id"] = ours.mask_token_id
    return result


def block_logits(ours, peer: dict) -> tuple:
    """Our import's logits ``[A*L, Vd]`` (and DSpark's confidence logits ``[A*L]``, else None) for every slot of the
    blocks at ``peer["anchors"]``: DSpark's Markov bias sees the block's own tokens before each slot (teacher
    forcing, as speculators trains it)."""
    import torch

    from tiny_speculators.models.dflash.objective import block_hidden

    ids, anchors = peer["input_ids"].long(), peer["anchors"].long()  # (T,), (A,)
    hidden, _ = block_hidden(ours, {"input_ids": ids[None], "aux_hidden_states": peer["aux"][None]}, anchors[None],
                             anchor_chunk=len(anchors))  # (1, A, L, H)
    if not hasattr(ours, "heads"):  # DFlash
        return ours.compute_logits(hidden).reshape(peer["logits"].shape).float(), None
    size = hidden.shape[2]
    prev = ids[anchors[:, None] + torch.arange(size)]  # (A, L): the token before each slot's prediction
    logits, confidence = ours.heads(hidden[0], prev)
    return logits.reshape(peer["logits"].shape), None if confidence is None else confidence.reshape(-1)


def evaluate_once(draft: Path, out: Path, a) -> dict:
    """Our evaluator on ``draft`` (reused when ``out`` already holds a run with the same settings)."""
    from tiny_speculators.evaluate.stage import evaluate

    settings = {"draft": str(draft), "k": a.k, "max_prompts": a.max_prompts, "max_new_tokens": a.max_new_tokens,
                "seed": a.seed, "mtime": (draft / "model.safetensors").stat().st_mtime}
    cached = out / "peer_settings.json"
    if cached.is_file() and json.loads(cached.read_text()) == settings and (out / "summary.json").is_file():
        return json.loads((out / "summary.json").read_text())
    ev = evaluate(a.verifier, draft, out, prompts="builtin", k=a.k, max_new_tokens=a.max_new_tokens,
                  max_prompts=a.max_prompts, seed=a.seed)
    cached.write_text(json.dumps(settings))
    return ev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, required=True, help="our pipeline run (its prepare/ and vocab/; read only)")
    ap.add_argument("--hidden-states", type=Path, required=True,
                    help="a full-layout fp32 extraction of the run's prepared data (extract --layout full)")
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--family", choices=["eagle3", "peagle", "dflash", "dspark"], default="eagle3",
                    help="speculators' draft family")
    ap.add_argument("--num-layers", type=int, default=2, help="P-EAGLE, DFlash, DSpark: draft decoder layers (ours: 2)")
    ap.add_argument("--block-size", type=int, default=4,
                    help="DFlash and DSpark: slots per block (configs/smollm2-135m-dflash.yaml, -dspark.yaml: 4)")
    ap.add_argument("--depths", type=int, default=4, help="P-EAGLE: parallel depths (ours: 4)")
    ap.add_argument("--overrides", default="{}", help="JSON: more speculators TrainConfig fields, e.g. "
                    "'{\"optimizer\": \"adamw\"}' for an ablation")
    ap.add_argument("--steps", type=int, default=405)
    ap.add_argument("--batch-tokens", type=int, default=2048, help="packed tokens per optimizer step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-fraction", type=float, default=0.05, help="our train stage's validation hold-out")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, required=True)
    a = ap.parse_args()
    from tiny_speculators.verifier.load import resolve_verifier

    a.work.mkdir(parents=True, exist_ok=True)
    a.verifier_dir = resolve_verifier(a.verifier)  # a local folder (speculators reads its config + weights)
    python = ensure_venv()
    info = convert(a.run, a.hidden_states, a.work / "data", a.seed, a.eval_fraction)
    t0 = time.perf_counter()
    summary = train(python, a.work / "data", info, a)
    train_wall = time.perf_counter() - t0
    draft = a.work / "train" / "draft"
    # the longest context: a packed training sequence, or a held-out prompt (under 200 characters) and its answer
    ours_draft = unwindowed(draft, max(a.batch_tokens, 1024 + a.max_new_tokens))
    parity = check_parity(python, draft, a.work / "data", a.work / "train", a.verifier, ours_draft=ours_draft)
    ev = evaluate_once(ours_draft, a.work / "evaluate", a)
    cfg = summary["resolved_config"]
    recipe = {key: cfg.get(key) for key in (
        "optimizer", "lr", "weight_decay", "muon_lr", "muon_momentum", "muon_weight_decay", "muon_ns_steps",
        "muon_adjust_lr_fn", "scheduler_type", "scheduler_warmup_steps", "scheduler_warmup_ratio", "loss_fn",
        "loss_implementation", "ttt_steps", "ttt_step_loss_decay", "per_position_loss_weight", "norm_before_fc",
        "norm_before_residual", "norm_output", "fc_norm", "embed_requires_grad", "sliding_window",
        "draft_attn_impl", "total_seq_len", "hidden_states_dtype", "train_data_ratio", "seed", "speculator_type",
        "num_layers", "num_depths", "down_sample_ratio", "down_sample_ratio_min", "max_anchors", "mask_token_id",
        "block_size", "sample_from_anchor", "dflash_decay_gamma", "dpace_alpha")}
    recipe["embed_requires_grad"] = summary.get("embed_requires_grad")
    if recipe["scheduler_warmup_steps"] is None and recipe["scheduler_warmup_ratio"] is None:
        recipe["scheduler_warmup_steps"] = summary["global_step"] // 100  # speculators' default: 1% of the steps
    results = {
        "peer": PEER, "torch": summary["torch_version"], "run": str(a.run), "hidden_states": str(a.hidden_states),
        "acceptance_length": ev["acceptance_length"], "per_position_acceptance": ev["per_position_acceptance"],
        "matches_baseline": ev["matches_baseline"], "k": a.k, "max_prompts": a.max_prompts,
        "max_new_tokens": a.max_new_tokens, "steps": summary["global_step"], "batch_tokens": a.batch_tokens,
        "epochs": summary["epochs"], "steps_per_epoch": summary["steps_per_epoch"],
        "train_tokens_per_epoch": summary["train_tokens_per_epoch"], "train_samples": summary["train_samples"],
        "train_seconds": summary["train_seconds"], "train_wall_seconds": train_wall, "data": info,
        "vocab": "ours (run/vocab d2t/t2d)", "recipe": recipe, "parity_with_speculators_forward": parity,
    }
    (a.work / "results.json").write_text(json.dumps(results, indent=2))
    per = " / ".join(f"{p:.3f}" for p in ev["per_position_acceptance"])
    print(f"{PEER} {a.family} (its default recipe: {recipe['optimizer']} lr {recipe['lr']}, "
          f"{recipe['scheduler_type']}, {recipe['loss_fn']}, ttt decay {recipe['ttt_step_loss_decay']}): "
          f"{summary['global_step']} steps x "
          f"{a.batch_tokens} tokens, train {summary['train_seconds']:.0f} s -> held-out τ "
          f"{ev['acceptance_length']:.3f} at k={a.k} ({per}), lossless {ev['matches_baseline']}; "
          f"{a.work / 'results.json'}")


if __name__ == "__main__":
    main()
