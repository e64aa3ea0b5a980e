"""The ``extract`` stage: run the frozen verifier over prepared sequences and store its EAGLE-3 hidden states.

Per token it stores the aux hidden states (inputs of layers 2, N//2, N-3 by default) and what reproduces the
verifier's distribution (the last layer's pre-norm output, or top-k logits with ``--layout topk``), in
checksummed safetensors shards with a manifest. Rerunning the same command resumes after the last complete
shard; ``--world-size/--rank`` (or torchrun's RANK/WORLD_SIZE) split the shards between processes writing
to the same folder; ``--verify DIR`` checks every shard of a finished extraction.

    tiny-speculators extract --data runs/prepared --out runs/extract            # verifier from the data summary
    tiny-speculators extract --verifier smollm2-135m --data runs/prepared --out runs/extract --layout fp8
    tiny-speculators extract --verify runs/extract
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Literal

import torch

from tiny_speculators.errors import UserError
from tiny_speculators.storage.layout import Layout, bytes_per_token
from tiny_speculators.storage.manifest import done_shards, init_plan, merge_manifest, shard_name, write_json_atomic
from tiny_speculators.storage.reader import verify_extraction
from tiny_speculators.storage.shards import ShardWriter
from tiny_speculators.verifier.capture import capture_hidden_states, check_layer_ids, default_aux_layer_ids
from tiny_speculators.verifier.describe import text_config
from tiny_speculators.verifier.load import load_tokenizer, load_verifier, verifier_id
from tiny_speculators.verifier.modules import VerifierParts, find_parts

__all__ = ["extract", "load_prepared_dir", "plan_shards", "token_batches"]

log = logging.getLogger(__name__)


def load_prepared_dir(data: Path):
    """``(dataset, summary)`` of a prepared folder (``dataset/`` + ``summary.json``), with clear errors."""
    import datasets

    data = Path(data)
    if not (data / "dataset").is_dir() or not (data / "summary.json").is_file():
        raise UserError(f"{data} is not a prepared dataset folder (needs dataset/ and summary.json; "
                        "run `tiny-speculators prepare` first)")
    try:
        dataset = datasets.load_from_disk(str(data / "dataset"))
        summary = json.loads((data / "summary.json").read_text())
    except (OSError, ValueError, FileNotFoundError) as e:
        raise UserError(f"cannot read prepared dataset {data}: {e}") from None
    missing = {"input_ids", "loss_mask"} - set(dataset.column_names)
    if missing:
        raise UserError(f"prepared dataset {data}/dataset lacks column(s) {sorted(missing)}")
    return dataset, summary


def _lengths(dataset) -> list[int]:
    import pyarrow.compute as pc

    if getattr(dataset, "_indices", None) is not None:
        dataset = dataset.flatten_indices()
    return pc.list_value_length(dataset.data.column("input_ids")).to_numpy(zero_copy_only=False).tolist()


def plan_shards(lengths: list[int], tokens_per_shard: int) -> list[dict[str, int]]:
    """Consecutive sample ranges of about ``tokens_per_shard`` tokens (a shard holds at least one sample)."""
    shards, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        tokens += n
        if tokens >= tokens_per_shard or i == len(lengths) - 1:
            shards.append({"start": start, "end": i + 1, "tokens": tokens})
            start, tokens = i + 1, 0
    return shards


def token_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group sample positions (longest first) so that batch size x longest length <= ``max_tokens``."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _resolve(device: str, dtype: str) -> tuple[str, str]:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return device, dtype


def _check_records(records: dict[str, list], start: int, data: Path, vocab: int) -> None:
    for j, (ids, mask) in enumerate(zip(records["input_ids"], records["loss_mask"], strict=True)):
        if len(ids) != len(mask):
            raise UserError(f"{data}: record {start + j} has {len(ids)} input_ids but {len(mask)} loss_mask values")
        if not ids:
            raise UserError(f"{data}: record {start + j} is empty")
        if max(ids) >= vocab or min(ids) < 0:
            raise UserError(f"{data}: record {start + j} has token id {max(ids)} outside the verifier's "
                            f"vocabulary of {vocab}: the dataset was prepared for another tokenizer")


@torch.inference_mode()
def _run_shard(model, parts: VerifierParts, records: dict[str, list], aux_ids: list[int], layout: Layout,
               device: str, max_tokens: int, store_dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """Forward the shard's samples in token-budget batches; per sample (in order) its stored tensors."""
    lengths = [len(x) for x in records["input_ids"]]
    results: list[dict[str, torch.Tensor] | None] = [None] * len(lengths)
    for batch in token_batches(lengths, max_tokens):
        width = lengths[batch[0]]
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):  # right padding, masked out
            ids[row, : lengths[i]] = torch.tensor(records["input_ids"][i])
            mask[row, : lengths[i]] = 1
        aux, last = capture_hidden_states(model, ids.to(device), mask.to(device), aux_ids, parts=parts)
        topk = None
        if layout.uses_topk:
            valid = mask.to(device).bool()
            rows = last[valid]  # (n_valid, H)
            ids_k, logits_k, lse = [], [], []
            for chunk in rows.split(1024):
                logits = parts.lm_head(parts.norm(chunk)).float()  # (c, V)
                values, indices = logits.topk(layout.topk, dim=-1)
                ids_k.append(indices.cpu())
                logits_k.append(values.cpu())
                lse.append(torch.logsumexp(logits, dim=-1).cpu())
            topk = (torch.cat(ids_k), torch.cat(logits_k), torch.cat(lse))
            split = torch.tensor([lengths[i] for i in batch]).cumsum(0).tolist()
        aux, last = aux.to("cpu", store_dtype), last.to("cpu", store_dtype)
        for row, i in enumerate(batch):
            n = lengths[i]
            out = {"input_ids": ids[row, :n], "loss_mask": torch.tensor(records["loss_mask"][i], dtype=torch.uint8),
                   "aux": aux[row, :n]}
            if topk is None:
                out["last"] = last[row, :n]
            else:
                a = split[row - 1] if row else 0
                out["topk_ids"], out["topk_logits"], out["logsumexp"] = (t[a:a + n] for t in topk)
            results[i] = out
    return results  # type: ignore[return-value]


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    r = rank if rank is not None else int(os.environ.get("RANK", "0"))
    if world < 1 or not 0 <= r < world:
        raise UserError(f"rank {r} is not valid for world size {world} (need 0 <= rank < world size)")
    return r, world


def _report(summary: dict[str, Any], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False)
    for key, value in summary.items():
        if not isinstance(value, (dict, list)):
            table.add_row(key, f"{value:,.3f}" if isinstance(value, float) else str(value))
    Console(stderr=True).print(table)


def extract(
    verifier: str | None = None,
    data: Path | None = None,
    out: Path | None = None,
    layers: list[int] | None = None,
    dtype: Literal["auto", "float32", "bfloat16"] = "auto",
    device: str = "auto",
    layout: Literal["full", "fp8", "topk", "fp8-topk"] = "full",
    topk: int = 64,
    max_tokens_per_batch: int = 8192,
    shard_mb: float = 256.0,
    world_size: int | None = None,
    rank: int | None = None,
    verify: Path | None = None,
    trust_remote_code: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Store the verifier's aux and last hidden states for every prepared sequence.

    Args:
        verifier: hub id, local folder or embedded name; default: the one recorded in the data's summary.json.
        data: a prepared dataset folder (output of `prepare`).
        out: output folder for shards, manifest.json and summary.json; rerunning resumes.
        layers: aux layer ids (id i = the input of layer i, HF hidden_states[i]); default [2, N//2, N-3].
        dtype: compute and storage dtype; auto = bfloat16 on CUDA, float32 on CPU.
        device: cpu, cuda, cuda:1, ... or auto (CUDA when available).
        layout: full = aux + last hidden state in dtype; fp8 = aux as float8 e4m3 with per-token scales;
            topk = top-k target logits (+ logsumexp) instead of the last hidden state; fp8-topk = both.
        topk: k for the topk layouts.
        max_tokens_per_batch: token budget per forward pass (batch size x longest sequence, padding included).
        shard_mb: approximate size of one shard file in MB.
        world_size: number of processes sharing the work (default: $WORLD_SIZE or 1).
        rank: this process's rank (default: $RANK or 0); shard k is written by rank (k mod world_size).
        verify: check every shard (sha256, shapes) of this finished extraction folder instead of extracting.
        trust_remote_code: allow the verifier's own modeling code from the hub.
        progress: show a progress bar with tokens/s.
    """
    if verify is not None:
        report = verify_extraction(verify)
        _report({k: v for k, v in report.items() if k != "problems"}, f"verify {verify}")
        if not report["ok"]:
            raise UserError(f"{len(report['problems'])} of {report['shards']} shards in {verify} are bad: "
                            + " | ".join(report["problems"]))
        return report
    if data is None or out is None:
        raise UserError("extract needs --data (a prepared dataset) and --out (or --verify DIR)")
    started = time.perf_counter()
    data, out = Path(data), Path(out)
    rank_, world = _rank_and_world(rank, world_size)
    dataset, prepared = load_prepared_dir(data)
    verifier = verifier or prepared.get("verifier")
    if not verifier:
        raise UserError(f"{data}/summary.json names no verifier; pass --verifier")
    device, dtype = _resolve(device, dtype)
    model, _ = load_verifier(verifier, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                             with_tokenizer=False)
    parts = find_parts(model)
    aux_ids = check_layer_ids(layers if layers else default_aux_layer_ids(parts.num_hidden_layers),
                              parts.num_hidden_layers)
    embed_vocab = parts.embed_tokens.num_embeddings
    data_vocab = prepared.get("vocab_size")
    if data_vocab is not None and int(data_vocab) > embed_vocab:
        raise UserError(f"{data} was prepared with a tokenizer of {data_vocab} tokens but verifier {verifier} "
                        f"embeds only {embed_vocab}: prepare the data with this verifier")
    try:
        tokenizer_size = len(load_tokenizer(verifier, trust_remote_code))
    except UserError:
        tokenizer_size = None  # no tokenizer next to the weights: rely on the vocabulary checks
    if tokenizer_size is not None and data_vocab is not None and int(data_vocab) != tokenizer_size:
        raise UserError(f"{data} was prepared with a tokenizer of {data_vocab} tokens, but verifier {verifier}'s "
                        f"tokenizer has {tokenizer_size}: prepare the data with this verifier's tokenizer")
    if prepared.get("verifier_id") and prepared["verifier_id"] != verifier_id(verifier):
        log.warning("%s was prepared for %s; extracting with %s", data, prepared["verifier_id"], verifier_id(verifier))
    store = Layout.parse(layout, topk)
    n_aux, hidden = len(aux_ids), parts.hidden_size
    per_token = bytes_per_token(store, n_aux, hidden, dtype)
    lengths = _lengths(dataset)
    if not lengths:
        raise UserError(f"prepared dataset {data} has no records")
    plan = plan_shards(lengths, max(1, int(shard_mb * 2**20 / per_token)))
    config = text_config(model.config)
    settings = {
        "verifier": str(verifier), "verifier_id": verifier_id(verifier),
        "verifier_revision": getattr(model.config, "_commit_hash", None),
        "architectures": list(getattr(model.config, "architectures", None) or []),
        "aux_layer_ids": aux_ids, "num_hidden_layers": parts.num_hidden_layers, "hidden_size": hidden,
        "vocab_size": int(getattr(config, "vocab_size", None) or parts.lm_head.weight.shape[0]),
        "dtype": dtype, "layout": store.name, "topk": store.topk or None,
        "layer_paths": {"layers": parts.layers_name, "norm": parts.norm_name, "lm_head": parts.lm_head_name},
        # not the path: nodes may mount shared storage at different places
        "dataset": {"fingerprint": getattr(dataset, "_fingerprint", None), "samples": len(lengths),
                    "tokens": int(sum(lengths))},
    }
    out.mkdir(parents=True, exist_ok=True)
    init_plan(out, settings, plan)
    done = done_shards(out)
    mine = [k for k in range(len(plan)) if k % world == rank_ and k not in done]
    for k in mine:  # leftovers of a killed run of this rank
        for tmp in out.glob(f".{shard_name(k)}.tmp-*"):
            tmp.unlink(missing_ok=True)
    if done:
        log.info("resuming: %d of %d shards already done", len(done), len(plan))
    todo_tokens = sum(plan[k]["tokens"] for k in mine)
    log.info("extract: %s layers %s (%s, %s, layout %s) -> %s: rank %d/%d writes %d shard(s), %d tokens",
             verifier, aux_ids, dtype, device, store.name, out, rank_, world, len(mine), todo_tokens)
    from tqdm.auto import tqdm

    writer = ShardWriter(out, rank_, store, n_aux)
    bar = tqdm(total=todo_tokens, unit="tok", unit_scale=True, desc=f"extract rank {rank_}",
               disable=None if progress else True)
    compute_started, tokens_done = time.perf_counter(), 0
    try:
        for n_done, k in enumerate(mine, 1):
            start, end = plan[k]["start"], plan[k]["end"]
            records = dataset[start:end]
            _check_records(records, start, data, embed_vocab)
            samples = _run_shard(model, parts, records, aux_ids, store, device, max_tokens_per_batch,
                                 torch.float32 if dtype == "float32" else torch.bfloat16)
            writer.submit(k, start, end, samples)
            bar.update(plan[k]["tokens"])
            tokens_done += plan[k]["tokens"]
            elapsed = time.perf_counter() - compute_started
            log.info("shard %d (%d/%d of this rank): %.0f tokens/s so far", k, n_done, len(mine),
                     tokens_done / elapsed if elapsed > 0 else 0.0)
        written = writer.close()
    except BaseException:
        with contextlib.suppress(Exception):
            writer.close()  # keep the shards that are complete; the original error wins
        raise
    finally:
        bar.close()
    seconds = time.perf_counter() - compute_started
    manifest = merge_manifest(out)
    tokens = sum(e["tokens"] for e in written)
    nbytes = sum(e["bytes"] for e in written)
    summary = {
        "rank": rank_, "world_size": world, "samples": sum(e["end"] - e["start"] for e in written),
        "tokens": tokens, "bytes": nbytes, "seconds": round(seconds, 3),
        "seconds_total": round(time.perf_counter() - started, 3),
        "tokens_per_second": round(tokens / seconds, 1) if seconds > 0 and tokens else 0.0,
        "bytes_per_token": round(nbytes / tokens, 1) if tokens else round(float(per_token), 1),
        "shards_written": len(written), "shards_total": len(plan), "complete": manifest is not None,
        "layout": store.name, "dtype": dtype, "device": device, "aux_layer_ids": aux_ids, "data": str(data),
    }
    if manifest is not None:
        summary.update({"total_samples": manifest["samples"], "total_tokens": manifest["tokens"],
                        "total_bytes": manifest["bytes"]})
    write_json_atomic(out / ("summary.json" if world == 1 else f"parts/summary-rank-{rank_:05d}.json"), summary)
    if world > 1 and manifest is not None:
        write_json_atomic(out / "summary.json", summary)
    _report(summary, f"extract -> {out}")
    return summary
