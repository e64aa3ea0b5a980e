"""``extract --reuse DIR``: an extraction that takes the samples an earlier one already holds from its shards and
runs the verifier only on the others (a nightly refresh pays for its new records, not for all of them again).

A sample is reused when an earlier shard holds the same token ids (its loss mask comes from the new data: it does
not change the verifier's states). The earlier extraction must have been made with the same settings (verifier,
layers, dtype, layout; the dataset may differ): its stored tensors are copied as they are (fp8 states with their
scales, not requantized), so a reused sample is bit-equal to what the earlier run stored. Only complete shards of
the earlier folder count (an interrupted one's finished shards too). The shard entries of the new extraction list
the samples they reused (``reused``: positions within the shard), which ``train --replay`` reads.

    index = ReuseIndex.open(Path("runs/extract.previous"), settings)
    index.copies            # a Source for shards it holds whole
    run = index.wrap(run)   # a Source for the others: it computes only what the index lacks
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tiny_speculators.errors import UserError
from tiny_speculators.storage.manifest import PLAN, done_shards, read_json
from tiny_speculators.storage.shards import REUSED

__all__ = ["REUSED", "ReuseIndex", "sample_key"]

log = logging.getLogger(__name__)

# a shard's tensor -> the name a sample dict gives it (what encode_shard packs)
_SAMPLE_NAMES = {"aux_hidden_states": "aux", "aux_scales": "aux_scales", "last_hidden_state": "last",
                 "target_topk_ids": "topk_ids", "target_topk_logits": "topk_logits", "target_logsumexp": "logsumexp"}
# what the two extractions must share for a stored sample to be what this one would compute
_DATASET_KEYS = ("dataset",)


def sample_key(input_ids: Any) -> bytes:
    """A sample's identity for reuse: the sha256 of its token ids as int32 bytes."""
    ids = torch.as_tensor(input_ids, dtype=torch.int32).contiguous()
    return hashlib.sha256(ids.numpy().tobytes()).digest()


class ReuseIndex:
    """The samples an earlier extraction folder holds, by :func:`sample_key`: where each lies (shard file, offsets)."""

    def __init__(self, folder: Path, where: dict[bytes, tuple[Path, int, int]]):
        self.folder = folder
        self._where = where
        self.reused = 0
        self._handles: dict[Path, Any] = {}

    @classmethod
    def open(cls, folder: Path, settings: dict[str, Any]) -> ReuseIndex | None:
        """The index of ``folder``'s complete shards; ``None`` (logged) when it holds nothing this extraction can
        reuse: no extraction there, or one made with other settings."""
        folder = Path(folder)
        if not (folder / PLAN).is_file():
            if folder.exists():
                log.warning("--reuse %s is not an extraction folder (no %s): extracting every sample", folder, PLAN)
                return None
            raise UserError(f"--reuse {folder} does not exist")
        earlier = read_json(folder / PLAN).get("settings", {})
        differ = sorted(k for k in {*settings, *earlier}
                        if k not in _DATASET_KEYS and settings.get(k) != earlier.get(k))
        if differ:
            log.warning("--reuse %s was extracted with other settings (%s): extracting every sample", folder,
                        "; ".join(f"{k}: {earlier.get(k)!r} there, {settings.get(k)!r} now" for k in differ))
            return None
        where: dict[bytes, tuple[Path, int, int]] = {}
        for entry in done_shards(folder).values():
            path = folder / entry["file"]
            with safe_open(str(path), framework="pt") as f:
                ids, offsets = f.get_tensor("input_ids"), f.get_tensor("sample_offsets").tolist()
            for a, b in itertools.pairwise(offsets):
                where.setdefault(sample_key(ids[a:b]), (path, a, b))
        log.info("--reuse %s: %d stored samples can be taken over", folder, len(where))
        return cls(folder, where)

    def __len__(self) -> int:
        return len(self._where)

    def covers(self, input_ids: list[list[int]]) -> bool:
        """Whether every one of these samples (their token ids) is held."""
        return all(sample_key(ids) in self._where for ids in input_ids)

    def take(self, records: dict[str, list], i: int) -> dict[str, torch.Tensor] | None:
        """Sample ``i`` of ``records`` as the earlier extraction stored it, or ``None`` when it holds no such one."""
        found = self._where.get(sample_key(records["input_ids"][i]))
        if found is None:
            return None
        path, a, b = found
        handle = self._handles.get(path)
        if handle is None:
            if len(self._handles) >= 4:  # a few open shards at a time (the order follows the new data)
                self._handles.pop(next(iter(self._handles)))
            handle = self._handles[path] = safe_open(str(path), framework="pt")
        sample = {"input_ids": torch.tensor(records["input_ids"][i], dtype=torch.long),
                  "loss_mask": torch.tensor(records["loss_mask"][i], dtype=torch.uint8), REUSED: True}
        for stored, name in _SAMPLE_NAMES.items():
            if stored in handle.keys():  # noqa: SIM118 (a safetensors handle has keys(), not __contains__)
                sample[name] = handle.get_slice(stored)[a:b]
        return sample

    def copies(self, shards: Iterable[dict[str, list]]) -> Iterator[list[dict[str, torch.Tensor]]]:
        """A source (see ``extract.Source``) for shards this index holds whole: their samples, copied."""
        for records in shards:
            taken = [self.take(records, i) for i in range(len(records["input_ids"]))]
            if any(t is None for t in taken):
                raise RuntimeError("a shard to copy holds a sample the earlier extraction does not")
            self.reused += len(taken)
            yield taken  # type: ignore[misc]

    def wrap(self, run):
        """A source (see ``extract.Source``) for shards with samples to compute: it takes what this index holds
        and hands only the others to ``run`` (one batch per shard, so its results come back shard by shard, in
        order); each sample comes out in its place."""
        def source(shards: Iterable[dict[str, list]]) -> Iterator[list[dict[str, torch.Tensor]]]:
            taken_per_shard: deque[list[dict | None]] = deque()

            def to_compute() -> Iterator[dict[str, list]]:
                for records in shards:
                    taken = [self.take(records, i) for i in range(len(records["input_ids"]))]
                    self.reused += sum(t is not None for t in taken)
                    taken_per_shard.append(taken)
                    yield {k: [v[i] for i, t in enumerate(taken) if t is None] for k, v in records.items()}

            for fresh in run(to_compute()):
                yield _merge(taken_per_shard.popleft(), fresh)

        return source


def _merge(taken: list[dict | None], fresh: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """The shard's samples in order: the taken ones where they were found, the computed ones in the gaps."""
    rest = iter(fresh)
    merged = [s if s is not None else next(rest) for s in taken]
    if next(rest, None) is not None:
        raise RuntimeError("the extraction source returned more samples than it was given")
    return merged
