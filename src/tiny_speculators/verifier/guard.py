"""A guard against bad hidden states, run on every shard before it is written (both ``extract`` backends).

Peers' users trained drafts on all-zero or NaN states extracted from a verifier (a hybrid MoE whose layers the
extraction missed, a connector that dropped data) and found out from ~0% acceptance. Here a shard is refused
before it is written when:

- an aux state of a sample is non-finite, all zero, or the same value everywhere;
- the stored last-layer state, through the verifier's own final norm and head (or the stored top-1 id of the
  top-k layouts), does not reproduce the verifier's own next-token choice at the positions the backend checked
  (the HF backend: positions of the shard's first sample, through the whole model's forward; the vLLM backend:
  each sample's last position, vLLM's greedy token) at least ``min_agreement`` of the time.

The error names the shard, the sample and the layer; the shards already written stay, and a rerun resumes once
the cause is fixed. Per position and per aux state the checks are a few reductions, next to a forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.storage.shards import REUSED

__all__ = ["DEFAULT_AGREEMENT", "GUARD_POSITIONS", "GUARD_TOKENS", "Guard", "default_agreement"]

GUARD_POSITIONS = "guard_positions"  # a sample's positions whose next token the backend took from the verifier
GUARD_TOKENS = "guard_tokens"  # the verifier's own next-token choice at those positions
DEFAULT_AGREEMENT = {"float32": 0.99, "bfloat16": 0.9}


def default_agreement(dtype: str) -> float:
    """The top-1 agreement a shard needs by default: 0.99 in fp32, 0.9 in bf16 (near-ties flip in bf16)."""
    return DEFAULT_AGREEMENT.get(dtype, DEFAULT_AGREEMENT["bfloat16"])


@dataclass
class Guard:
    """Checks the samples of one shard at a time; :attr:`checked` and :attr:`agreed` count the positions so far.

    Args:
        aux_ids: the aux layer ids, in the order of the samples' ``aux`` columns.
        hidden_size: the width of one aux state.
        head: the verifier's final norm + lm_head (``TargetHead``: pre-norm state -> logits); None for the top-k
            layouts.
        min_agreement: the least fraction of checked positions whose prediction must equal the verifier's own
            choice, per shard; 0 turns that check off (the aux checks stay).
    """

    aux_ids: Sequence[int]
    hidden_size: int
    head: nn.Module | None
    min_agreement: float
    checked: int = field(default=0, init=False)
    agreed: int = field(default=0, init=False)

    def check_shard(self, shard: int, first_sample: int, samples: list[dict[str, torch.Tensor]]) -> None:
        """A one-line :class:`UserError` naming the shard, sample and layer when a sample's states are bad."""
        checked = agreed = 0
        first_miss: tuple[int, int, int, int] | None = None  # sample, position, predicted, verifier's
        for j, sample in enumerate(samples):
            if sample.get(REUSED):  # taken over from an earlier extraction, whose guard checked it
                continue
            self._check_aux(shard, first_sample + j, sample["aux"])
            if GUARD_POSITIONS not in sample or self.min_agreement <= 0:
                continue
            positions, wanted = sample[GUARD_POSITIONS], sample[GUARD_TOKENS]
            predicted = self._predict(sample, positions)
            hits = predicted == wanted
            checked += len(positions)
            agreed += int(hits.sum())
            if first_miss is None and not bool(hits.all()):
                miss = int((~hits).nonzero()[0])
                first_miss = (first_sample + j, int(positions[miss]), int(predicted[miss]), int(wanted[miss]))
        self.checked += checked
        self.agreed += agreed
        if checked and agreed < self.min_agreement * checked:
            assert first_miss is not None
            sample, position, got, want = first_miss
            raise UserError(
                f"shard {shard}: the stored last-layer states reproduce the verifier's own next token at only "
                f"{agreed} of {checked} checked positions (needed {self.min_agreement:.0%}); first miss: sample "
                f"{sample}, position {position}, token {got} instead of {want}. The states are not the verifier's: "
                "check --layers and the backend (shards before this one are kept; a rerun resumes), or lower "
                "--guard-agreement for a bf16 or quantized verifier")

    def _predict(self, sample: dict[str, torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
        if "topk_ids" in sample:
            return sample["topk_ids"][positions, 0].long()
        if self.head is None:
            raise ValueError("the guard needs the verifier's head to check last-layer states")
        weight = next(self.head.parameters())
        with torch.inference_mode():
            return self.head(sample["last"][positions].to(weight.device, weight.dtype)).float().argmax(-1).cpu()

    def _check_aux(self, shard: int, sample: int, aux: torch.Tensor) -> None:
        states = aux.float().view(aux.shape[0], len(self.aux_ids), self.hidden_size)
        for column, layer in enumerate(self.aux_ids):
            state = states[:, column]
            problem = None
            if not bool(torch.isfinite(state).all()):
                problem = "holds NaN or infinite values"
            elif not bool(state.any()):
                problem = "is all zeros"
            elif bool(state.amax() == state.amin()):
                problem = f"holds the same value ({float(state.flatten()[0]):g}) everywhere"
            if problem is not None:
                raise UserError(
                    f"shard {shard}: aux layer {layer} of sample {sample} {problem}: the states are not the "
                    "verifier's (a layer id the backend does not capture, or a dropped transfer); shards before "
                    "this one are kept, a rerun resumes once the cause is fixed")
