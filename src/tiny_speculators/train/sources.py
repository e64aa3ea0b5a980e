"""Where a micro-batch's hidden states come from: extract's shards (offline) or the verifier itself (online).

Both sources give the trainer the same batch: ``input_ids``, ``loss_mask``, ``attention_mask``,
``position_ids`` (+ ``document_ids`` when packed), ``aux_hidden_states [B, T, n_aux*Ht]`` and
``last_hidden_state [B, T, Ht]`` (pre-norm; the target head turns it into verifier logits), so the
model, loss and metrics cannot tell them apart. Offline shards written with a top-k layout carry
``target_topk_ids`` / ``target_topk_logits [B, T, k]`` instead of ``last_hidden_state`` (see ``TopKTargets`` in
``models/losses.py`` for what the losses do with them).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tiny_speculators.data.prepared import load_prepared
from tiny_speculators.errors import UserError
from tiny_speculators.storage.reader import HiddenStateReader
from tiny_speculators.train.data import collate, prompt_keys
from tiny_speculators.verifier.capture import capture_hidden_states
from tiny_speculators.verifier.modules import find_parts
from tiny_speculators.verifier.vision import PreparedImages, Vision

log = logging.getLogger(__name__)


class OfflineSource:
    """Samples from ``extract``'s shards (checksums verified when the reader opens them).

    ``aux_layer_ids`` picks a subset of the stored layers (one extraction with the union of several families'
    layers serves them all); ``None`` reads every stored layer.
    """

    def __init__(self, hidden_states: Path, verify: bool = True, aux_layer_ids: list[int] | None = None) -> None:
        self.reader = HiddenStateReader(hidden_states, verify=verify)
        self.manifest: dict[str, Any] = self.reader.manifest
        if len(self.reader) == 0:
            raise UserError(f"hidden-state folder {hidden_states} holds no samples")
        stored = [int(i) for i in self.manifest["aux_layer_ids"]]
        wanted = stored if aux_layer_ids is None else [int(i) for i in aux_layer_ids]
        missing = [i for i in wanted if i not in stored]
        if missing:
            raise UserError(f"--aux-layer-ids {wanted}: layer(s) {missing} are not stored in {hidden_states} "
                            f"(manifest.json holds {stored}); extract them, or train on a subset of those")
        self._aux = wanted
        # which stored slots to keep, in the requested order (None: all, as stored)
        self._slots = None if wanted == stored else [stored.index(i) for i in wanted]
        self._lengths = [int(n) for n in self.reader.lengths()]  # from the shards' offset tensors only
        # what reproduces the verifier's distribution: its last hidden state, or its stored top-k logits
        self.target_keys = (("target_topk_ids", "target_topk_logits") if self.reader.layout.uses_topk
                            else ("last_hidden_state",))

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self._aux)

    def __len__(self) -> int:
        return len(self.reader)

    def lengths(self) -> list[int]:
        return self._lengths

    def prompt_keys(self) -> list[bytes]:
        """:func:`~tiny_speculators.train.data.prompt_key` of every sample (the validation split keeps each on one
        side)."""
        return prompt_keys(self.reader.token_columns())

    def reused_samples(self) -> set[int]:
        """The samples ``extract --reuse`` took over from an earlier extraction (its shard entries list them)."""
        return {int(s["start"]) + j for s in self.manifest["shards"] for j in s.get("reused", [])}

    def batch(self, indices: list[int], device: torch.device, pack: bool) -> dict[str, Any]:
        keys = ("input_ids", "loss_mask", "aux_hidden_states", *self.target_keys,
                *(("position_ids",) if self.manifest.get("position_ids") else ()))
        samples = [{k: s[k] for k in keys} for s in (self.reader[i] for i in indices)]
        if self._slots is not None:
            for s in samples:
                aux = s["aux_hidden_states"]  # (T, n_stored*H)
                s["aux_hidden_states"] = aux.view(aux.shape[0], -1, aux.shape[1] // len(self.manifest[
                    "aux_layer_ids"]))[:, self._slots].reshape(aux.shape[0], -1)  # (T, n_aux*H)
        return to_device(collate(samples, pack=pack), device)


class PreparedTokens:
    """The token side of the online sources: a prepared dataset's ``input_ids`` and ``loss_mask``, each sample cut
    to ``max_length``; the source that extends it adds the hidden states (the verifier here, or vLLM producers).
    Only sources that feed images (``reads_images``) take data prepared with images."""

    reads_images = False

    def __init__(self, prepared: Path, max_length: int | None) -> None:
        self.dataset = _load_prepared_dataset(prepared)
        if len(self.dataset) == 0:
            raise UserError(f"prepared dataset {prepared} holds no samples")
        self.has_images = "images" in self.dataset.column_names and any(self.dataset["images"])
        if self.has_images and not self.reads_images:
            raise UserError(f"prepared dataset {prepared} holds images: train it offline (extract, then train "
                            "--hidden-states) or online in this process (--producer hf)")
        if self.has_images and max_length is not None:
            raise UserError(f"prepared dataset {prepared} holds images: --max-length would cut through them; "
                            "prepare with --max-length instead (it never cuts an image)")
        self.max_length = max_length
        self._lengths = [min(len(x), max_length or len(x)) for x in self.dataset["input_ids"]]

    def __len__(self) -> int:
        return len(self.dataset)

    def lengths(self) -> list[int]:
        return self._lengths

    def prompt_keys(self) -> list[bytes]:
        return prompt_keys(zip(self.dataset["input_ids"], self.dataset["loss_mask"], strict=True))

    def token_samples(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """``input_ids`` and ``loss_mask`` of each sample, cut to ``max_length``."""
        rows = self.dataset[list(indices)]
        n = self.max_length
        return [{"input_ids": torch.tensor(ids[:n] if n else ids), "loss_mask": torch.tensor(m[:n] if n else m)}
                for ids, m in zip(rows["input_ids"], rows["loss_mask"], strict=True)]


class OnlineSource(PreparedTokens):
    """Token ids from a prepared dataset; the verifier (in this process) computes aux/last per micro-batch (with
    the samples' images and the draft's positions for a vision-language verifier, as extract stores them)."""

    reads_images = True

    def __init__(self, prepared: Path, verifier: nn.Module, aux_layer_ids: list[int], max_length: int | None,
                 verifier_name: str | None = None, trust_remote_code: bool = False) -> None:
        super().__init__(prepared, max_length)
        self.verifier = verifier
        self.parts = find_parts(verifier)
        self.aux_layer_ids = list(aux_layer_ids)
        self.images = None
        if self.has_images:
            vision = Vision.load(verifier_name, trust_remote_code) if verifier_name else None
            if vision is None or self.parts.multimodal is None:
                raise UserError(f"prepared dataset {prepared} holds images, but verifier {verifier_name} reads none")
            self.images = PreparedImages(vision, Path(prepared))

    @torch.inference_mode()
    def _states(self, indices: list[int], padded: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        """aux, last (and the draft's positions, with images) of the padded batch of samples ``indices``."""
        ids, mask = padded["input_ids"], padded["attention_mask"]
        if self.images is None:
            return capture_hidden_states(self.verifier, ids, mask, self.aux_layer_ids, parts=self.parts)
        rows = self.dataset[list(indices)]
        inputs = self.images.of(rows, list(range(len(indices))), ids, self.parts.embed_tokens.weight.dtype,
                                ids.device)
        aux, last = capture_hidden_states(self.verifier, ids, mask, self.aux_layer_ids, parts=self.parts,
                                          images=inputs)
        return aux, last, self.images.positions(self.parts, ids, mask, inputs)

    def batch(self, indices: list[int], device: torch.device, pack: bool) -> dict[str, Any]:
        samples = self.token_samples(indices)
        batch = to_device(collate(samples, pack=pack), device)
        # the verifier sees each document separately: packed, it runs on the padded form, then the states are packed
        padded = to_device(collate(samples, pack=False), device) if pack else batch
        states = self._states(indices, padded)
        keep = padded["attention_mask"].bool()
        # clone outside inference mode: inference tensors cannot be saved for backward
        for key, value in zip(("aux_hidden_states", "last_hidden_state", "position_ids"), states, strict=False):
            if key == "position_ids":
                value = torch.where(keep, value, padded["position_ids"])  # padding continues as collate's
            batch[key] = value[keep][None].clone() if pack else value.clone()
        return batch


def _load_prepared_dataset(prepared: Path):
    return load_prepared(prepared).dataset


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
