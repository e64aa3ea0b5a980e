"""The ``extract`` stage: run the frozen verifier over prepared sequences and store its EAGLE-3 hidden states.

Per token it stores the aux hidden states (inputs of layers 2, N//2, N-3 by default) and what reproduces the
verifier's distribution (the last layer's pre-norm output, or top-k logits with ``--layout topk``), in
checksummed safetensors shards with a manifest. Rerunning the same command resumes after the last complete
shard; ``--world-size/--rank`` (or torchrun's RANK/WORLD_SIZE) split the shards between processes writing
to the same folder; ``--verify DIR`` checks every shard of a finished extraction.

Two backends compute the states and share everything else (plan, shard loop, writer, manifest):
``--backend hf`` (default, the exact reference) runs the verifier in this process with ``transformers``;
``--backend vllm`` has vLLM prefill the tokens with its ``extract_hidden_states`` method, from the separate
vLLM environment (``scripts/vllm_env.sh``; see :mod:`.vllm_extract`), so anything vLLM serves can be extracted.

    tiny-speculators extract --data runs/prepared --out runs/extract            # verifier from the data summary
    tiny-speculators extract --verifier smollm2-135m --data runs/prepared --out runs/extract --layout fp8
    tiny-speculators extract --data runs/prepared --out runs/extract-vllm --backend vllm
    tiny-speculators extract --verify runs/extract
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm.auto import tqdm

from tiny_speculators.errors import UserError
from tiny_speculators.serving import sigterm_as_exit
from tiny_speculators.storage.layout import Layout, bytes_per_token
from tiny_speculators.storage.manifest import done_shards, init_plan, merge_manifest, shard_name, write_json_atomic
from tiny_speculators.storage.reader import verify_extraction
from tiny_speculators.storage.shards import ShardWriter
from tiny_speculators.tables import print_summary_table
from tiny_speculators.verifier.capture import (
    capture_hidden_states,
    check_layer_ids,
    default_aux_layer_ids,
    first_aux_layer,
)
from tiny_speculators.verifier.describe import text_config
from tiny_speculators.verifier.guard import GUARD_POSITIONS, GUARD_TOKENS, Guard, default_agreement
from tiny_speculators.verifier.head import TargetHead, load_verifier_head
from tiny_speculators.verifier.load import load_tokenizer, load_verifier, parse_dtype, verifier_id
from tiny_speculators.verifier.modules import VerifierParts, find_parts
from tiny_speculators.verifier.reuse import ReuseIndex
from tiny_speculators.verifier.vision import PreparedImages, Vision
from tiny_speculators.verifier.vllm_extract import LOG_NAME, VllmHiddenStates, verifier_skeleton, vllm_extract_python

__all__ = ["Source", "extract", "load_prepared_dir", "make_sample", "plan_shards", "token_batches"]

log = logging.getLogger(__name__)

# a backend: the records (input_ids, loss_mask lists) of each shard in turn -> that shard's samples, in order
Source = Callable[[Iterable[dict[str, list]]], Iterator[list[dict[str, torch.Tensor]]]]


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
def _topk_targets(head: Callable[[torch.Tensor], torch.Tensor], last: torch.Tensor, k: int, device: str):
    """Top-k ids and logits and the logsumexp of all logits, per row of ``last`` (T, H) (pre-norm)."""
    ids_k, logits_k, lse = [], [], []
    for chunk in last.split(1024):
        logits = head(chunk.to(device)).float()  # (c, V)
        values, indices = logits.topk(k, dim=-1)
        ids_k.append(indices.cpu())
        logits_k.append(values.cpu())
        lse.append(torch.logsumexp(logits, dim=-1).cpu())
    return torch.cat(ids_k), torch.cat(logits_k), torch.cat(lse)


def make_sample(records: dict[str, list], i: int, aux: torch.Tensor, last: torch.Tensor, layout: Layout,
                store_dtype: torch.dtype, head: Callable[[torch.Tensor], torch.Tensor] | None = None,
                device: str = "cpu") -> dict[str, torch.Tensor]:
    """What a shard stores of sample ``i`` of ``records``, from its aux (T, n_aux*H) and last (T, H) states
    (both backends end here); ``head`` (norm + lm_head) gives the top-k targets of the topk layouts."""
    out = {"input_ids": torch.tensor(records["input_ids"][i], dtype=torch.long),
           "loss_mask": torch.tensor(records["loss_mask"][i], dtype=torch.uint8),
           "aux": aux.to("cpu", store_dtype)}
    if layout.uses_topk:
        assert head is not None
        out["topk_ids"], out["topk_logits"], out["logsumexp"] = _topk_targets(head, last, layout.topk, device)
    else:
        out["last"] = last.to("cpu", store_dtype)
    return out


@torch.inference_mode()
def _run_shard(model, parts: VerifierParts, records: dict[str, list], aux_ids: list[int], layout: Layout,
               device: str, max_tokens: int, store_dtype: torch.dtype, images: PreparedImages | None = None
               ) -> list[dict[str, torch.Tensor]]:
    """Forward the shard's samples in token-budget batches (with their images, if any); per sample (in order) its
    stored tensors."""
    lengths = [len(x) for x in records["input_ids"]]
    results: list[dict[str, torch.Tensor] | None] = [None] * len(lengths)
    head = TargetHead(parts.norm, parts.lm_head)
    dtype = parts.embed_tokens.weight.dtype
    for batch in token_batches(lengths, max_tokens):
        width = lengths[batch[0]]
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):  # right padding, masked out
            ids[row, : lengths[i]] = torch.tensor(records["input_ids"][i])
            mask[row, : lengths[i]] = 1
        pixels = images.of(records, batch, ids, dtype, device) if images is not None else None
        aux, last = capture_hidden_states(model, ids.to(device), mask.to(device), aux_ids, parts=parts,
                                          images=pixels)
        positions = images.positions(parts, ids.to(device), mask.to(device), pixels) if images else None
        for row, i in enumerate(batch):
            n = lengths[i]
            results[i] = make_sample(records, i, aux[row, :n], last[row, :n], layout, store_dtype, head, device)
            if positions is not None:
                results[i]["positions"] = positions[row, :n].cpu()
    first = torch.tensor([records["input_ids"][0]])
    pixels = images.of(records, [0], first, dtype, device) if images is not None else None
    results[0].update(_verifier_choices(model, first, device, pixels))  # type: ignore[union-attr]
    return results  # type: ignore[return-value]


@torch.inference_mode()
def _verifier_choices(model, ids: torch.Tensor, device: str, images: dict[str, torch.Tensor] | None = None,
                      count: int = 64) -> dict[str, torch.Tensor]:
    """The guard's reference: the whole verifier's own greedy next token at ``count`` positions spread over one
    sample (``ids`` (1, T), with its images; its forward computes logits only there)."""
    n = ids.shape[1]
    positions = torch.linspace(0, n - 1, min(count, n)).round().long().unique()
    logits = model(input_ids=ids.to(device), use_cache=False, logits_to_keep=positions.to(device),
                   **(images or {})).logits[0]
    return {GUARD_POSITIONS: positions, GUARD_TOKENS: logits.float().argmax(-1).cpu()}


def _hf_source(model, parts: VerifierParts, aux_ids: list[int], layout: Layout, device: str, max_tokens: int,
               store_dtype: torch.dtype, images: PreparedImages | None = None) -> Source:
    def run(shards: Iterable[dict[str, list]]) -> Iterator[list[dict[str, torch.Tensor]]]:
        for records in shards:
            yield _run_shard(model, parts, records, aux_ids, layout, device, max_tokens, store_dtype, images)

    return run


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    r = rank if rank is not None else int(os.environ.get("RANK", "0"))
    if world < 1 or not 0 <= r < world:
        raise UserError(f"rank {r} is not valid for world size {world} (need 0 <= rank < world size)")
    return r, world


def _report(summary: dict[str, Any], title: str) -> None:
    print_summary_table(title, [(key, f"{value:,.3f}" if isinstance(value, float) else str(value))
                                for key, value in summary.items() if not isinstance(value, (dict, list))])


def _settings(verifier: str, model, parts: VerifierParts, aux_ids: list[int], dtype: str, store: Layout,
              dataset, lengths: list[int], backend: str) -> dict[str, Any]:
    """What decides the shards' contents (``plan.json``): a rerun with other settings is refused."""
    config = text_config(model.config)
    return {
        "verifier": str(verifier), "verifier_id": verifier_id(verifier),
        "verifier_revision": getattr(model.config, "_commit_hash", None),
        "architectures": list(getattr(model.config, "architectures", None) or []),
        "aux_layer_ids": aux_ids, "num_hidden_layers": parts.num_hidden_layers, "hidden_size": parts.hidden_size,
        "vocab_size": int(getattr(config, "vocab_size", None) or parts.lm_head.weight.shape[0]),
        "dtype": dtype, "layout": store.name, "topk": store.topk or None,
        "layer_paths": {"layers": parts.layers_name, "norm": parts.norm_name, "lm_head": parts.lm_head_name},
        # not the path: nodes may mount shared storage at different places
        "dataset": {"fingerprint": getattr(dataset, "_fingerprint", None), "samples": len(lengths),
                    "tokens": int(sum(lengths))},
        "backend": backend,
    }


def _vllm_source(stack: contextlib.ExitStack, python: Path, source: str, head: TargetHead, aux_ids: list[int],
                 parts: VerifierParts, store: Layout, dtype: str, device: str, out: Path, rank: int,
                 max_model_len: int, max_tokens: int, enforce_eager: bool, trust_remote_code: bool) -> Source:
    """Start the vLLM worker (stopped when ``stack`` closes) and return it as a source; ``head`` (the verifier's
    own norm + lm_head, loaded alone) gives the top-k layouts' targets."""
    store_dtype = torch.float32 if dtype == "float32" else torch.bfloat16

    def sample(records: dict[str, list], i: int, aux: torch.Tensor, last: torch.Tensor) -> dict[str, torch.Tensor]:
        return make_sample(records, i, aux, last, store, store_dtype, head, device)

    suffix = "" if rank == 0 else f"-rank-{rank:05d}"
    stack.enter_context(sigterm_as_exit())
    return stack.enter_context(VllmHiddenStates(
        python, source, aux_ids, parts.num_hidden_layers, dtype, out / f".vllm-scratch{suffix}",
        out / LOG_NAME.format(suffix), sample, max_model_len=max_model_len, max_num_batched_tokens=max_tokens,
        enforce_eager=enforce_eager, trust_remote_code=trust_remote_code))


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
    backend: Literal["hf", "vllm"] = "hf",
    vllm_venv: Path | None = None,
    allow_untested_vllm: bool = False,
    enforce_eager: bool = True,
    trust_remote_code: bool = False,
    guard_agreement: float | None = None,
    reuse: Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Store the verifier's aux and last hidden states for every prepared sequence.

    Args:
        verifier: hub id, local folder or embedded name; default: the one recorded in the data's summary.json.
        data: a prepared dataset folder (output of `prepare`).
        out: output folder for shards, manifest.json and summary.json; rerunning resumes.
        layers: aux layer ids (id i = the input of layer i, HF hidden_states[i]); default [2, N//2, N-3].
        dtype: compute and storage dtype; auto = bfloat16 on CUDA, float32 on CPU.
        device: cpu, cuda, cuda:1, ... or auto (CUDA when available); with backend vllm, where the top-k
            layouts' head runs (vLLM picks its own device).
        layout: full = aux + last hidden state in dtype; fp8 = aux as float8 e4m3 with per-token scales;
            topk = top-k target logits (+ logsumexp) instead of the last hidden state; fp8-topk = both.
        topk: k for the topk layouts.
        max_tokens_per_batch: token budget per forward pass (batch size x longest sequence, padding included;
            with backend vllm: vLLM's max_num_batched_tokens).
        shard_mb: approximate size of one shard file in MB.
        world_size: number of processes sharing the work (default: $WORLD_SIZE or 1).
        rank: this process's rank (default: $RANK or 0); shard k is written by rank (k mod world_size).
        verify: check every shard (sha256, shapes) of this finished extraction folder instead of extracting.
        backend: hf = the verifier in this process (transformers; the exact reference); vllm = vLLM's
            extract_hidden_states method, from the vLLM environment (scripts/vllm_env.sh), same output.
        vllm_venv: the vLLM environment for backend vllm (default: $TINY_SPECULATORS_VLLM_VENV, else
            ~/.cache/tiny-speculators/vllm-venv, built there on first use).
        allow_untested_vllm: go on with a vLLM version outside the tested range (backend vllm).
        enforce_eager: backend vllm: no torch.compile / CUDA graphs (a CPU engine is ready in ~30 s, not minutes).
        trust_remote_code: allow the verifier's own modeling code from the hub.
        guard_agreement: the guard against bad states (:mod:`.guard`): the least fraction of checked positions per
            shard where the stored last-layer state reproduces the verifier's own next token; default 0.99 in
            float32, 0.9 in bfloat16; 0 checks only that no aux state is non-finite, all zero or constant.
        progress: show a progress bar with tokens/s.
    """
    if verify is not None:
        return _verify(verify)
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
    with_images = "images" in dataset.column_names and any(dataset["images"])
    if with_images and backend != "hf":
        raise UserError(f"{data} holds images: extract --backend {backend} does not feed images yet; use "
                        "--backend hf")
    if with_images and reuse is not None:
        raise UserError(f"{data} holds images: --reuse matches token ids only, which do not tell images apart")
    model, source, vllm_py = _load(verifier, backend, dtype, device, out, vllm_venv, allow_untested_vllm,
                                   trust_remote_code)
    parts = find_parts(model)
    aux_ids = check_layer_ids(layers if layers else default_aux_layer_ids(parts.num_hidden_layers,
                                                                          first_aux_layer(model.config)),
                              parts.num_hidden_layers)
    images = _images_of(data, verifier, trust_remote_code) if with_images else None
    embed_vocab = parts.embed_tokens.num_embeddings
    _check_vocabulary(data, prepared, verifier, embed_vocab, trust_remote_code)
    store = Layout.parse(layout, topk)
    n_aux, hidden = len(aux_ids), parts.hidden_size
    per_token = bytes_per_token(store, n_aux, hidden, dtype)
    lengths = _lengths(dataset)
    if not lengths:
        raise UserError(f"prepared dataset {data} has no records")
    plan = plan_shards(lengths, max(1, int(shard_mb * 2**20 / per_token)))
    settings = _settings(verifier, model, parts, aux_ids, dtype, store, dataset, lengths, backend)
    if images is not None:  # each sample's draft positions (position_ids) are stored too
        settings["position_ids"] = True
    if reuse is not None and Path(reuse).resolve() == out.resolve():
        raise UserError(f"--reuse {reuse} is the --out folder: reuse an earlier extraction's folder")
    index = ReuseIndex.open(Path(reuse), settings) if reuse is not None else None
    out.mkdir(parents=True, exist_ok=True)
    init_plan(out, settings, plan)
    mine = _shards_of_rank(out, plan, rank_, world)
    log.info("extract (%s): %s layers %s (%s, %s, layout %s) -> %s: rank %d/%d writes %d shard(s), %d tokens",
             backend, verifier, aux_ids, dtype, device, store.name, out, rank_, world, len(mine),
             sum(plan[k]["tokens"] for k in mine))
    store_dtype = torch.float32 if dtype == "float32" else torch.bfloat16

    def shard_records(k: int) -> dict[str, list]:
        start, end = plan[k]["start"], plan[k]["end"]
        records = dataset[start:end]
        _check_records(records, start, data, embed_vocab)
        return records

    head = (load_verifier_head(verifier, parse_dtype(dtype), trust_remote_code).target_head.to(device)
            if backend == "vllm" else TargetHead(parts.norm, parts.lm_head))
    guard = Guard(aux_ids, hidden, head, default_agreement(dtype) if guard_agreement is None else guard_agreement)
    # with --reuse, the shards copied whole come first: a kill while the others compute keeps them
    copied = set() if index is None else {k for k in mine if index.covers(dataset[plan[k]["start"]:plan[k]["end"]][
        "input_ids"])}
    to_compute = [k for k in mine if k not in copied]
    with contextlib.ExitStack() as stack:  # holds the vLLM worker, if any
        if backend == "vllm" and to_compute:
            run = _vllm_source(stack, vllm_py, source, head, aux_ids, parts, store, dtype, device, out, rank_,
                               max(lengths) + 1, max_tokens_per_batch, enforce_eager, trust_remote_code)
        else:
            run = _hf_source(model, parts, aux_ids, store, device, max_tokens_per_batch, store_dtype, images)
        groups = [(to_compute, run)] if index is None else [
            (sorted(copied), index.copies), (to_compute, index.wrap(run))]
        written, seconds = [], 0.0
        for group, source_of in groups:
            if group:
                done, took = _write_shards(ShardWriter(out, rank_, store, n_aux), source_of, shard_records, plan,
                                           group, rank_, progress, guard)
                written, seconds = written + done, seconds + took
    manifest = merge_manifest(out)
    summary = {
        "rank": rank_, "world_size": world, **_measures(written, seconds, started, per_token),
        "shards_written": len(written), "shards_total": len(plan), "complete": manifest is not None,
        "layout": store.name, "dtype": dtype, "device": device, "backend": backend, "aux_layer_ids": aux_ids,
        "data": str(data), "guard_positions": guard.checked, "guard_agreed": guard.agreed,
        **({"reuse": str(reuse), "reused_samples": index.reused if index else 0} if reuse is not None else {}),
    }
    _write_summary(out, summary, manifest, rank_, world)
    _report(summary, f"extract -> {out}")
    return summary


def _images_of(data: Path, verifier: str, trust_remote_code: bool) -> PreparedImages:
    """The image inputs' maker for prepared data with images (the HF backend only, and no ``--reuse``: its index
    matches token ids, which do not tell two images of one size apart)."""
    vision = Vision.load(verifier, trust_remote_code)
    if vision is None:
        raise UserError(f"{data} holds images, but verifier {verifier} has no image processor")
    return PreparedImages(vision, data)


def _load(verifier: str, backend: str, dtype: str, device: str, out: Path, vllm_venv: Path | None,
          allow_untested_vllm: bool, trust_remote_code: bool) -> tuple[Any, str | None, Path | None]:
    """The verifier (with backend vllm: its skeleton, the weights stay with vLLM), vLLM's source name for it and
    the vLLM environment's interpreter (both None with backend hf)."""
    if backend == "vllm":  # first: a missing or untested vLLM fails before anything is loaded
        vllm_py = vllm_extract_python(vllm_venv, out, allow_untested_vllm)
        model, source = verifier_skeleton(verifier, trust_remote_code)  # weights stay with vLLM
        return model, source, vllm_py
    model, _ = load_verifier(verifier, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                             with_tokenizer=False)
    return model, None, None


def _verify(verify: Path) -> dict[str, Any]:
    """``--verify``: check every shard of a finished extraction; bad shards are an error naming each."""
    report = verify_extraction(verify)
    _report({k: v for k, v in report.items() if k != "problems"}, f"verify {verify}")
    if not report["ok"]:
        raise UserError(f"{len(report['problems'])} of {report['shards']} shards in {verify} are bad: "
                        + " | ".join(report["problems"]))
    return report


def _check_vocabulary(data: Path, prepared: dict[str, Any], verifier: str, embed_vocab: int,
                      trust_remote_code: bool) -> None:
    """The data was prepared with this verifier's tokenizer (as far as its summary.json and the verifier tell)."""
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


def _shards_of_rank(out: Path, plan: list[dict[str, int]], rank: int, world: int) -> list[int]:
    """The shards this rank still has to write (rank k mod world), with a killed run's leftovers removed."""
    done = done_shards(out)
    mine = [k for k in range(len(plan)) if k % world == rank and k not in done]
    for k in mine:  # leftovers of a killed run of this rank
        for tmp in out.glob(f".{shard_name(k)}.tmp-*"):
            tmp.unlink(missing_ok=True)
    if done:
        log.info("resuming: %d of %d shards already done", len(done), len(plan))
    return mine


def _write_shards(writer: ShardWriter, run: Source, shard_records: Callable[[int], dict[str, list]],
                  plan: list[dict[str, int]], mine: list[int], rank: int, progress: bool,
                  guard: Guard) -> tuple[list[dict[str, Any]], float]:
    """Compute, check (``guard``) and write this rank's shards in order: what was written, and the seconds it took."""
    bar = tqdm(total=sum(plan[k]["tokens"] for k in mine), unit="tok", unit_scale=True, desc=f"extract rank {rank}",
               disable=None if progress else True)
    compute_started, tokens_done = time.perf_counter(), 0
    try:
        for n_done, (k, samples) in enumerate(zip(mine, run(shard_records(k) for k in mine), strict=True), 1):
            guard.check_shard(k, plan[k]["start"], samples)
            writer.submit(k, plan[k]["start"], plan[k]["end"], samples)
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
    return written, time.perf_counter() - compute_started


def _measures(written: list[dict[str, Any]], seconds: float, started: float, per_token: float) -> dict[str, Any]:
    tokens = sum(e["tokens"] for e in written)
    nbytes = sum(e["bytes"] for e in written)
    return {
        "samples": sum(e["end"] - e["start"] for e in written),
        "tokens": tokens, "bytes": nbytes, "seconds": round(seconds, 3),
        "seconds_total": round(time.perf_counter() - started, 3),
        "tokens_per_second": round(tokens / seconds, 1) if seconds > 0 and tokens else 0.0,
        "bytes_per_token": round(nbytes / tokens, 1) if tokens else round(float(per_token), 1),
    }


def _write_summary(out: Path, summary: dict[str, Any], manifest: dict[str, Any] | None, rank: int,
                   world: int) -> None:
    """This rank's summary (with the totals once every shard is written); summary.json is the last rank's."""
    if manifest is not None:
        summary.update({"total_samples": manifest["samples"], "total_tokens": manifest["tokens"],
                        "total_bytes": manifest["bytes"]})
    write_json_atomic(out / ("summary.json" if world == 1 else f"parts/summary-rank-{rank:05d}.json"), summary)
    if world > 1 and manifest is not None:
        write_json_atomic(out / "summary.json", summary)
