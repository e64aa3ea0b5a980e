"""Shard files: encoding samples into one safetensors file, a background writer, and shard validation.

A shard is written in one piece (``safetensors.torch.save`` -> sha256 of the bytes -> temp file -> fsync
-> ``os.replace``) by a background thread, so the disk write overlaps the next shard's forward passes; only
then is it listed in the rank's part file (see :mod:`tiny_speculators.storage.manifest`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from tiny_speculators.errors import UserError
from tiny_speculators.storage.layout import STORE_DTYPES, Layout, quantize_fp8
from tiny_speculators.storage.manifest import record_shard, shard_name, write_bytes_atomic

__all__ = ["REUSED", "ShardWriter", "encode_shard", "open_shard", "sha256_file"]

log = logging.getLogger(__name__)

# a sample's marker: copied from an earlier extraction's shard (``extract --reuse``), its fp8 states (``aux`` with
# ``aux_scales``) as they were stored; its shard's entry lists it under this name
REUSED = "reused"


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file's bytes, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def encode_shard(layout: Layout, n_aux: int, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pack samples (each: input_ids, loss_mask, aux, and last or topk_ids/topk_logits/logsumexp) into tensors; an
    fp8 layout's sample that carries ``aux_scales`` holds its ``aux`` quantized already (one scale per token and
    layer, so quantizing sample by sample equals quantizing the shard)."""
    lengths = torch.tensor([0] + [len(s["input_ids"]) for s in samples], dtype=torch.int64)
    tensors = {
        "input_ids": torch.cat([s["input_ids"] for s in samples]).to(torch.int32),  # (N,)
        "loss_mask": torch.cat([s["loss_mask"] for s in samples]).to(torch.uint8),  # (N,)
        "sample_offsets": torch.cumsum(lengths, 0),  # (n+1,)
    }
    if "positions" in samples[0]:  # a vision-language verifier's: the RoPE positions a text-only draft runs at
        tensors["position_ids"] = torch.cat([s["positions"] for s in samples]).to(torch.int32)  # (N,)
    if layout.aux_fp8:
        quantized = [(s["aux"], s["aux_scales"]) if "aux_scales" in s else quantize_fp8(s["aux"], n_aux)
                     for s in samples]
        tensors["aux_hidden_states"] = torch.cat([q for q, _ in quantized])  # (N, n_aux*H) float8
        tensors["aux_scales"] = torch.cat([scale for _, scale in quantized])  # (N, n_aux)
    else:
        tensors["aux_hidden_states"] = torch.cat([s["aux"] for s in samples])  # (N, n_aux*H)
    if layout.uses_topk:
        tensors["target_topk_ids"] = torch.cat([s["topk_ids"].to(torch.int32) for s in samples])  # (N, k)
        tensors["target_topk_logits"] = torch.cat([s["topk_logits"].float() for s in samples])  # (N, k)
        tensors["target_logsumexp"] = torch.cat([s["logsumexp"].float() for s in samples])  # (N,)
    else:
        tensors["last_hidden_state"] = torch.cat([s["last"] for s in samples])  # (N, H)
    return {k: v.contiguous() for k, v in tensors.items()}


class ShardWriter:
    """Encodes, checksums and atomically writes shards on a background thread, then records them.

    ``submit`` blocks while ``max_pending`` shards are waiting; an error in the thread is raised by the
    next ``submit`` or by ``close``.
    """

    def __init__(self, out: Path, rank: int, layout: Layout, n_aux: int, max_pending: int = 1):
        self.out, self.rank, self.layout, self.n_aux = Path(out), rank, layout, n_aux
        self.entries: list[dict[str, Any]] = []
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"shard-writer-{rank}", daemon=True)
        self._thread.start()

    def submit(self, index: int, start: int, end: int, samples: list[dict[str, torch.Tensor]]) -> None:
        if self._error is not None:
            self.close()
        self._queue.put((index, start, end, samples))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue  # keep draining so that submit() never blocks forever
            try:
                self._write(*item)
            except BaseException as e:  # re-raised in the main thread
                self._error = e

    def _write(self, index: int, start: int, end: int, samples: list[dict[str, torch.Tensor]]) -> None:
        tensors = encode_shard(self.layout, self.n_aux, samples)
        # one metadata key: safetensors writes a map's keys in random order, and shard bytes must be reproducible
        about = json.dumps({"index": index, "start": start, "end": end, "layout": self.layout.name}, sort_keys=True)
        data = save(tensors, metadata={"tiny_speculators": about})
        name = shard_name(index)
        write_bytes_atomic(self.out / name, data)
        entry = {"index": index, "file": name, "start": start, "end": end,
                 "tokens": int(tensors["input_ids"].numel()), "bytes": len(data),
                 "sha256": hashlib.sha256(data).hexdigest(), "rank": self.rank}
        reused = [j for j, s in enumerate(samples) if s.get(REUSED)]
        if reused:  # positions within the shard taken over from an earlier extraction (train --replay reads them)
            entry[REUSED] = reused
        record_shard(self.out, self.rank, entry)
        self.entries.append(entry)
        log.debug("wrote %s (%d samples, %d tokens, %.1f MB)", name, end - start, entry["tokens"], len(data) / 1e6)

    def close(self) -> list[dict[str, Any]]:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self.entries


def expected_tensors(manifest: dict[str, Any], n: int, tokens: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype name) that a shard of ``n`` samples and ``tokens`` tokens must hold."""
    layout = Layout.parse(manifest["layout"], manifest.get("topk") or 0)
    n_aux, hidden = len(manifest["aux_layer_ids"]), manifest["hidden_size"]
    store = str(STORE_DTYPES[manifest["dtype"]]).removeprefix("torch.")
    spec = {"input_ids": ((tokens,), "int32"), "loss_mask": ((tokens,), "uint8"),
            "sample_offsets": ((n + 1,), "int64")}
    if manifest.get("position_ids"):
        spec["position_ids"] = ((tokens,), "int32")
    if layout.aux_fp8:
        spec["aux_hidden_states"] = ((tokens, n_aux * hidden), "float8_e4m3fn")
        spec["aux_scales"] = ((tokens, n_aux), "float32")
    else:
        spec["aux_hidden_states"] = ((tokens, n_aux * hidden), store)
    if layout.uses_topk:
        spec["target_topk_ids"] = ((tokens, layout.topk), "int32")
        spec["target_topk_logits"] = ((tokens, layout.topk), "float32")
        spec["target_logsumexp"] = ((tokens,), "float32")
    else:
        spec["last_hidden_state"] = ((tokens, hidden), store)
    return spec


def open_shard(directory: Path, entry: dict[str, Any], manifest: dict[str, Any], check_sha: bool = True):
    """Open one shard lazily (memory-mapped) after checking its checksum, tensor names, shapes and dtypes.

    Raises:
        UserError: naming the shard file, when it is missing, corrupted, unreadable or has the wrong shapes.
    """
    path = Path(directory) / entry["file"]
    if not path.is_file():
        raise UserError(f"shard {path} is missing")
    if check_sha:
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            raise UserError(f"shard {path} is corrupted: sha256 {digest[:16]}... does not match the manifest's "
                            f"{entry['sha256'][:16]}...; extract it again (delete the file and rerun extract)")
    try:
        handle = safe_open(str(path), framework="pt")
        keys = set(handle.keys())
        spec = expected_tensors(manifest, entry["end"] - entry["start"], entry["tokens"])
        if keys != set(spec):
            raise UserError(f"shard {path} holds tensors {sorted(keys)}, expected {sorted(spec)}")
        for name, (shape, dtype) in spec.items():
            sl = handle.get_slice(name)
            got_shape, got_dtype = tuple(sl.get_shape()), _DTYPE_CODES.get(sl.get_dtype(), sl.get_dtype())
            if got_shape != shape or got_dtype != dtype:
                raise UserError(f"shard {path}: tensor {name} is {got_dtype} {list(got_shape)}, "
                                f"expected {dtype} {list(shape)}")
        offsets = handle.get_tensor("sample_offsets")
        if offsets[0] != 0 or offsets[-1] != entry["tokens"] or bool((offsets[1:] < offsets[:-1]).any()):
            raise UserError(f"shard {path}: sample_offsets are inconsistent with its {entry['tokens']} tokens")
    except (SafetensorError, OSError, RuntimeError) as e:
        raise UserError(f"shard {path} is unreadable: {e}") from None
    return handle, offsets


_DTYPE_CODES = {"I32": "int32", "U8": "uint8", "I64": "int64", "F32": "float32", "BF16": "bfloat16",
                "F16": "float16", "F8_E4M3": "float8_e4m3fn"}
