"""Batches for the trainer: a deterministic plan of which samples go into which micro-batch on which rank,
and collation (right padding, or packing into one row with ``document_ids``).

The plan is a pure function of (seed, epoch, sample lengths, batch settings, world size x grad accum),
so every rank computes the same plan without talking, each rank takes a disjoint share, and resume
only needs ``(epoch, step_in_epoch)``. One optimizer step consumes ``world_size * grad_accum``
micro-batches; micro-batch ``j`` of a step goes to rank ``j % world_size`` as its ``j // world_size``-th
accumulation micro-batch.

Sources: offline, samples come from ``extract``'s shards (:class:`~tiny_speculators.storage.reader.HiddenStateReader`,
checksums verified); online, from the prepared dataset (token ids only) and the verifier computes the hidden
states per micro-batch (see ``online.py``).

    plan = plan_epoch(list(range(100)), lengths, epoch=0, seed=0, batch_size=4, batch_tokens=None, micro_per_step=2)
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import torch

from tiny_speculators.errors import UserError

# per-token tensors a sample may carry (hidden states, or the verifier's top-k from extract's topk layouts)
TOKEN_TENSOR_KEYS = ("aux_hidden_states", "last_hidden_state", "target_topk_ids", "target_topk_logits")

Plan = list[list[list[int]]]  # step -> micro-batches (world_size * grad_accum of them) -> sample indices


def split_train_val(n: int, eval_fraction: float, seed: int,
                    groups: Sequence[Hashable] | None = None) -> tuple[list[int], list[int]]:
    """A seeded split of ``range(n)`` into (train, val); val has ``round(n * eval_fraction)`` samples.

    ``groups`` (one key per sample, e.g. :func:`prompt_key`) keeps the samples of a group on one side: whole groups,
    in seeded order, go to val until it holds at least that many samples. With every key distinct (or no
    ``groups``) the split is the same as the plain one."""
    if not 0.0 <= eval_fraction < 1.0:
        raise UserError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    n_val = round(n * eval_fraction)
    if eval_fraction > 0 and n_val == 0 and n > 1:
        n_val = 1
    members: dict[Hashable, list[int]] = {}
    for i, key in enumerate(groups if groups is not None else range(n)):
        members.setdefault(key, []).append(i)
    order = list(members.values())  # groups in order of first appearance
    g = torch.Generator().manual_seed(seed)
    val: list[int] = []
    for k in torch.randperm(len(order), generator=g).tolist():
        if len(val) >= n_val:
            break
        val.extend(order[k])
    held = set(val)
    train = [i for i in range(n) if i not in held]
    if not train:
        raise UserError(f"no training samples left after holding out {len(val)} of {n} for validation")
    return train, sorted(val)


def replay_sample(train: Sequence[int], reused: set[int], fraction: float,
                  seed: int) -> tuple[list[int], dict[str, int]]:
    """The training samples of a refresh: every one not in ``reused`` (computed anew), plus a seeded draw of
    ``round(fraction x their number)`` of those that are, in ``train``'s order; and the counts of each."""
    new = [i for i in train if i not in reused]
    old = [i for i in train if i in reused]
    g = torch.Generator().manual_seed(seed + 1)  # not the split's own stream
    drawn = {old[k] for k in torch.randperm(len(old), generator=g)[: round(fraction * len(old))].tolist()}
    kept = [i for i in train if i not in reused or i in drawn]
    if not kept:
        raise UserError(f"--replay {fraction}: nothing to train on (no new samples and none of the {len(old)} "
                        "taken-over ones drawn)")
    return kept, {"new": len(new), "replayed": len(drawn), "reused": len(old)}


def prompt_keys(columns: Iterable[tuple[Sequence[int], Sequence[int]]]) -> list[bytes]:
    """:func:`prompt_key` of every ``(input_ids, loss_mask)`` pair, e.g. a reader's ``token_columns()``."""
    return [prompt_key(ids, mask) for ids, mask in columns]


def prompt_key(input_ids: Sequence[int], loss_mask: Sequence[int]) -> bytes:
    """What a sample was asked: a digest of its tokens before the first supervised one. Answers to the same prompt
    (``regenerate --extra-answers``) and the turns of one split conversation share it."""
    first = next((j for j, m in enumerate(loss_mask) if m), len(loss_mask))
    return hashlib.blake2b(struct.pack(f"<{first}q", *input_ids[:first]), digest_size=16).digest()


def group_micro_batches(order: Sequence[int], lengths: Sequence[int], *, batch_size: int,
                        batch_tokens: int | None, pack: bool) -> list[list[int]]:
    """Cut ``order`` into micro-batches: ``batch_size`` samples each, or as many consecutive samples as fit
    ``batch_tokens`` (padded tokens ``n * max_len``; with ``pack``, the sum of lengths). A sample longer than
    the budget gets a micro-batch of its own."""
    if not batch_tokens:
        return [list(order[i:i + batch_size]) for i in range(0, len(order), batch_size)]
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = cur_sum = 0
    for i in order:
        n = lengths[i]
        new_max, new_sum = max(cur_max, n), cur_sum + n
        cost = new_sum if pack else new_max * (len(cur) + 1)
        if cur and cost > batch_tokens:
            batches.append(cur)
            cur, new_max, new_sum = [], n, n
        cur.append(i)
        cur_max, cur_sum = new_max, new_sum
    if cur:
        batches.append(cur)
    return batches


def plan_epoch(indices: Sequence[int], lengths: Sequence[int], *, epoch: int, seed: int, batch_size: int,
               batch_tokens: int | None, micro_per_step: int, pack: bool = False, shuffle: bool = True) -> Plan:
    """The optimizer steps of one epoch (an incomplete last step is dropped)."""
    order = list(indices)
    if shuffle:
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = [order[i] for i in torch.randperm(len(order), generator=g).tolist()]
    micro = group_micro_batches(order, lengths, batch_size=batch_size, batch_tokens=batch_tokens, pack=pack)
    n_steps = len(micro) // micro_per_step
    return [micro[s * micro_per_step:(s + 1) * micro_per_step] for s in range(n_steps)]


def rank_share(step_micro: list[list[int]], rank: int, world_size: int) -> list[list[int]]:
    """This rank's accumulation micro-batches of one step."""
    return step_micro[rank::world_size]


def eval_share(indices: Sequence[int], lengths: Sequence[int], *, batch_size: int, batch_tokens: int | None,
               rank: int, world_size: int, pack: bool = False) -> list[list[int]]:
    """Validation micro-batches of this rank (all validation samples are covered exactly once)."""
    micro = group_micro_batches(list(indices), lengths, batch_size=batch_size, batch_tokens=batch_tokens, pack=pack)
    return micro[rank::world_size]


def collate(samples: list[dict[str, torch.Tensor]], *, pack: bool = False) -> dict[str, Any]:
    """Samples (each ``input_ids [T]``, ``loss_mask [T]`` and optionally ``aux_hidden_states [T, A]``,
    ``last_hidden_state [T, H]`` or ``target_topk_ids/logits [T, k]``) -> a batch.

    Padding (default): ``[B, Tmax]`` rows padded on the right (``loss_mask`` 0, ``attention_mask`` 0 there,
    hidden states 0); causal attention keeps real positions unaffected by the padding.
    Packing: one row ``[1, sum T]``, ``document_ids`` per token and positions restarting per sample.
    Samples that carry ``position_ids [T]`` (a vision-language verifier's text positions, which skip ahead past
    an image) keep them; padding continues each row's last position.
    """
    if not samples:
        raise ValueError("empty micro-batch")
    tensor_keys = [k for k in TOKEN_TENSOR_KEYS if k in samples[0]]
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    if pack:
        batch: dict[str, Any] = {
            "input_ids": torch.cat([s["input_ids"].long() for s in samples])[None],
            "loss_mask": torch.cat([s["loss_mask"].long() for s in samples])[None],
            "position_ids": torch.cat([_positions(s, n) for s, n in zip(samples, lengths, strict=True)])[None],
            "document_ids": torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None],
            "attention_mask": torch.ones(1, sum(lengths), dtype=torch.long),
        }
        for k in tensor_keys:
            batch[k] = torch.cat([s[k] for s in samples])[None]
        return batch
    b, t = len(samples), max(lengths)
    input_ids = torch.zeros(b, t, dtype=torch.long)
    loss_mask = torch.zeros(b, t, dtype=torch.long)
    attention_mask = torch.zeros(b, t, dtype=torch.long)
    for i, (s, n) in enumerate(zip(samples, lengths, strict=True)):
        input_ids[i, :n] = s["input_ids"].long()
        loss_mask[i, :n] = s["loss_mask"].long()
        attention_mask[i, :n] = 1
    position_ids = torch.arange(t)[None].repeat(b, 1)
    for i, (s, n) in enumerate(zip(samples, lengths, strict=True)):
        if "position_ids" in s:
            position_ids[i, :n] = s["position_ids"].long()
            position_ids[i, n:] = position_ids[i, n - 1] + 1 + torch.arange(t - n)
    batch = {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention_mask,
             "position_ids": position_ids}
    for k in tensor_keys:
        out = samples[0][k].new_zeros(b, t, samples[0][k].shape[-1])
        for i, (s, n) in enumerate(zip(samples, lengths, strict=True)):
            out[i, :n] = s[k]
        batch[k] = out
    return batch


def _positions(sample: dict[str, torch.Tensor], n: int) -> torch.Tensor:
    return sample["position_ids"].long() if "position_ids" in sample else torch.arange(n)


def batch_tokens_of(batch: dict[str, Any]) -> int:
    return int(batch["attention_mask"].sum())


def steps_per_epoch_estimate(n: int, batch_size: int, micro_per_step: int) -> int:
    return max(0, math.ceil(n / batch_size) // micro_per_step)
