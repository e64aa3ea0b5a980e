"""Read extracted hidden states sample by sample (used by ``train``), verifying every shard before use.

Shards are opened lazily and memory-mapped (a small LRU of open shards), each checked once per reader
against the manifest's sha256 and expected shapes; a corrupted or unreadable shard raises a
:class:`~tiny_speculators.errors.UserError` naming the file, never silently yields data.

    from tiny_speculators.storage.reader import HiddenStateReader
    reader = HiddenStateReader("runs/extract")
    sample = reader[0]; print(len(reader), sample["aux_hidden_states"].shape)
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tiny_speculators.errors import UserError
from tiny_speculators.storage.layout import STORE_DTYPES, Layout, dequantize_fp8
from tiny_speculators.storage.manifest import load_manifest
from tiny_speculators.storage.shards import open_shard

__all__ = ["HiddenStateReader", "verify_extraction"]


class HiddenStateReader:
    """Random access to the samples of an extraction folder.

    ``reader[i]`` returns a dict with
      - ``input_ids``: LongTensor (T,)
      - ``loss_mask``: LongTensor (T,) of 0/1
      - ``position_ids``: LongTensor (T,), only where the manifest says ``position_ids`` (a vision-language
        verifier's data): the RoPE positions the text-only draft runs at (the M-RoPE temporal row)
      - ``aux_hidden_states``: float (T, n_aux*H), the inputs of ``manifest["aux_layer_ids"]`` concatenated in
        that order (fp8 layouts are dequantized transparently)
      - layouts ``full``/``fp8``: ``last_hidden_state`` float (T, H), the final layer's PRE-norm output, so
        ``lm_head(norm(last))`` equals the verifier's logits
      - layouts ``topk``/``fp8-topk`` instead: ``target_topk_ids`` LongTensor (T, k), ``target_topk_logits``
        float32 (T, k) and ``target_logsumexp`` float32 (T,) (the logsumexp of ALL the verifier's logits, so
        ``exp(target_topk_logits - target_logsumexp[:, None])`` are exact probabilities)

    Args:
        directory: the extract output folder.
        verify: check each shard's sha256 (once, on first use) before reading it.
        dtype: dtype of the returned hidden states (default: the manifest's ``dtype``, which fp8 layouts
            dequantize to).
        max_open_shards: how many shards stay memory-mapped at once.
    """

    def __init__(self, directory: str | Path, verify: bool = True, dtype: torch.dtype | None = None,
                 max_open_shards: int = 4):
        self.directory = Path(directory)
        self.manifest: dict[str, Any] = load_manifest(self.directory)
        self.verify = verify
        self.layout = Layout.parse(self.manifest["layout"], self.manifest.get("topk") or 0)
        self.dtype = dtype or STORE_DTYPES[self.manifest["dtype"]]
        self.max_open_shards = max_open_shards
        self._shards = self.manifest["shards"]
        self._starts = [s["start"] for s in self._shards]
        self._open: OrderedDict[int, tuple[Any, torch.Tensor]] = OrderedDict()
        self._verified: set[int] = set()

    def __len__(self) -> int:
        return self.manifest["samples"]

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers reopen shards themselves
        state = self.__dict__.copy()
        state["_open"] = OrderedDict()
        return state

    def _shard(self, k: int) -> tuple[Any, torch.Tensor]:
        if k in self._open:
            self._open.move_to_end(k)
            return self._open[k]
        opened = open_shard(self.directory, self._shards[k], self.manifest,
                            check_sha=self.verify and k not in self._verified)
        self._verified.add(k)
        self._open[k] = opened
        while len(self._open) > self.max_open_shards:
            self._open.popitem(last=False)
        return opened

    def lengths(self) -> list[int]:
        """Token count of every sample, for length-bucketed batching.

        Reads only each shard's header and small offset tensor (no checksum pass over the data: that
        happens, as always, when a shard's samples are first read)."""
        out: list[int] = []
        for k, entry in enumerate(self._shards):
            offsets = self._open[k][1] if k in self._open else open_shard(
                self.directory, entry, self.manifest, check_sha=False)[1]
            out.extend((offsets[1:] - offsets[:-1]).tolist())
        return out

    def token_columns(self) -> Iterator[tuple[list[int], list[int]]]:
        """Every sample's ``(input_ids, loss_mask)``, in order. Reads only those two columns of each shard (no
        checksum pass: that happens when a shard's samples are first read)."""
        for k, entry in enumerate(self._shards):
            handle, offsets = self._open[k] if k in self._open else open_shard(
                self.directory, entry, self.manifest, check_sha=False)
            ids, mask = handle.get_tensor("input_ids").tolist(), handle.get_tensor("loss_mask").tolist()
            bounds = offsets.tolist()
            for a, b in itertools.pairwise(bounds):
                yield ids[a:b], mask[a:b]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        k = bisect.bisect_right(self._starts, i) - 1
        handle, offsets = self._shard(k)
        j = i - self._shards[k]["start"]
        a, b = int(offsets[j]), int(offsets[j + 1])

        def rows(name: str) -> torch.Tensor:
            return handle.get_slice(name)[a:b]

        sample = {"input_ids": rows("input_ids").long(), "loss_mask": rows("loss_mask").long()}
        if self.manifest.get("position_ids"):
            sample["position_ids"] = rows("position_ids").long()
        if self.layout.aux_fp8:
            sample["aux_hidden_states"] = dequantize_fp8(rows("aux_hidden_states"), rows("aux_scales"), self.dtype)
        else:
            sample["aux_hidden_states"] = rows("aux_hidden_states").to(self.dtype)
        if self.layout.uses_topk:
            sample["target_topk_ids"] = rows("target_topk_ids").long()
            sample["target_topk_logits"] = rows("target_topk_logits")
            sample["target_logsumexp"] = rows("target_logsumexp")
        else:
            sample["last_hidden_state"] = rows("last_hidden_state").to(self.dtype)
        return sample


def verify_extraction(directory: str | Path, share: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """Check every shard of an extraction (presence, sha256, tensor shapes); returns a report.

    The report has ``ok`` (bool), ``shards``, ``samples``, ``tokens``, ``bytes`` and ``problems``
    (one sentence per bad shard). An incomplete extraction raises :class:`UserError`.
    ``share=(rank, world_size)`` checks only shards ``rank::world_size``: ranks that read one extraction on
    shared storage split the checksum pass between them (the counts in the report stay the whole extraction's).
    """
    directory = Path(directory)
    manifest = load_manifest(directory)
    problems = []
    rank, world_size = share
    for entry in manifest["shards"][rank::world_size]:
        try:
            open_shard(directory, entry, manifest, check_sha=True)
        except UserError as e:
            problems.append(str(e))
    return {"ok": not problems, "directory": str(directory), "shards": len(manifest["shards"]),
            "samples": manifest["samples"], "tokens": manifest["tokens"], "bytes": manifest["bytes"],
            "problems": problems}
