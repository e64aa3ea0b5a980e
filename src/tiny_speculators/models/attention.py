"""Attention kernels, the drafts' KV cache and the training-time-test (TTT) attention masks, shared by every
family whose draft attends over a cache (EAGLE-3, P-EAGLE, MTP).

Two kernels compute the same thing:

* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with an explicit boolean mask
  ``[B, 1, T, S]`` (True = attend). Runs everywhere; the mask costs ``B*T*S`` bytes.
* ``flex``: ``torch.nn.attention.flex_attention`` with a ``BlockMask`` built from a ``mask_mod``
  (no dense mask; fast when compiled on GPU). On CPU it runs eagerly (slow reference path).

TTT mask (step ``k`` of a ``steps``-step rollout; keys are laid out step-major: key index
``i * T + j`` is step ``i``'s key at anchor position ``j``). A query of step ``k`` at anchor ``t``
attends to

* step-0 keys ``j <= t`` of the same document (causal, packed documents never see each other), and
* the keys of steps ``1..k`` at the same anchor ``t`` only (the "diagonal": the tokens this
  position itself drafted earlier in the rollout).

This is exactly what the draft sees when vLLM serves it: the prefill wrote one key per context
position, and each later draft step appended one key for the single position it extends.

A sliding-window draft (``window`` W, as vLLM runs a draft layer whose config says ``sliding_attention``) sees
only keys less than W positions before its query: the query of step ``k`` at anchor ``t`` sits at position
``t + k``, a step-0 key ``j`` at ``j`` and the step-``i`` key of the same anchor at ``t + i``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:  # flex-attention is in torch >= 2.5; keep the sdpa path usable without it.
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # pragma: no cover - depends on the installed torch
    BlockMask = None  # type: ignore[assignment,misc]
    create_block_mask = flex_attention = None  # type: ignore[assignment]


_COMPILED_FLEX = None


class KVCache:
    """Keys/values of the draft's first attention layer, ``[B, n_kv, S, D]`` each (post-RoPE), and those of any
    later layers in caches of their own (:meth:`layer`).

    ``forward(..., cache=cache)`` appends the new keys/values; ``crop(n)`` drops everything after
    the first ``n`` positions of every layer (rollback after rejected draft tokens).
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.later: list[KVCache] = []  # layers 1, 2, ...

    def layer(self, index: int) -> KVCache:
        """The cache of decoder layer ``index`` (this one for 0), made on first use."""
        if index == 0:
            return self
        while len(self.later) < index:
            self.later.append(KVCache())
        return self.later[index - 1]

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k = torch.cat([self.k, k], dim=2)
            self.v = torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        if length < 0 or length > self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        if self.k is not None:
            self.k = self.k[:, :, :length]
            self.v = self.v[:, :, :length]
        for cache in self.later:
            cache.crop(length)

    def reset(self) -> None:
        self.k = self.v = None
        self.later = []


def flex_available() -> bool:
    return flex_attention is not None


def _flex_kernel(device: torch.device):
    """Compiled flex-attention on accelerators (eager flex materializes the full score matrix);
    torch's eager reference path on CPU (slow, forward-only: fine for tests)."""
    global _COMPILED_FLEX
    if device.type == "cpu":
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def is_block_mask(mask) -> bool:
    return BlockMask is not None and isinstance(mask, BlockMask)


@dataclass(frozen=True)
class PackedTTTMask:
    """The TTT mask of packed documents, applied document by document (sdpa path).

    One dense mask over a packed row of ``T`` tokens costs ``T * (step+1) * T`` scores, almost all of them
    masked (documents never see each other). Instead, :func:`attend` gathers each document's queries and
    keys into a padded block ``[n_docs, L]`` (``L`` = longest document), runs sdpa with the plain TTT mask of
    length ``L``, and scatters the outputs back: ``n_docs * L * (step+1) * L`` scores, same result.
    Build it with :func:`packed_ttt_mask`.
    """

    step: int
    index: torch.Tensor  # [n_docs, L] long: flat (b * T + t) token of each block slot (pads repeat a real token)
    valid: torch.Tensor  # [n_docs, L] bool: slot holds a real token
    window: int | None = None  # a sliding-window draft's window (module docstring)


def document_blocks(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` document ids (contiguous runs) -> (``index``, ``valid``) of :class:`PackedTTTMask`."""
    b = document_ids.shape[0]
    flat = (document_ids.long() - document_ids.min() + 1) * b + torch.arange(b, device=document_ids.device)[:, None]
    _, lengths = torch.unique_consecutive(flat.reshape(-1), return_counts=True)
    starts = torch.cumsum(lengths, 0) - lengths
    width = int(lengths.max())
    slot = torch.arange(width, device=document_ids.device)
    valid = slot[None, :] < lengths[:, None]
    index = starts[:, None] + torch.where(valid, slot[None, :], 0)
    return index, valid


def packed_ttt_mask(step: int, document_ids: torch.Tensor, window: int | None = None) -> PackedTTTMask:
    index, valid = document_blocks(document_ids)
    return PackedTTTMask(step, index, valid, window)


def _attend_packed(q, k, v, mask: PackedTTTMask, scale: float) -> torch.Tensor:
    b, hq, t, d = q.shape
    steps = mask.step + 1
    n, width = mask.index.shape

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [B, H, steps*T, D] (step-major keys) -> [n, H, steps*L, D]
        h = x.shape[1]
        x = x.reshape(b, h, steps, t, d).permute(2, 0, 3, 1, 4).reshape(steps, b * t, h, d)[:, mask.index]
        return x.permute(1, 3, 0, 2, 4).reshape(n, h, steps * width, d)  # (n, H, steps, L, D) step-major

    q_blocks = q.transpose(1, 2).reshape(b * t, hq, d)[mask.index].transpose(1, 2)  # (n, Hq, L, D)
    dense = ttt_mask_dense(mask.step, width, device=q.device, window=mask.window)  # (1, 1, L, steps*L)
    out = attend(q_blocks, blocks(k), blocks(v), dense, scale=scale)  # (n, Hq, L, D)
    flat = q.new_zeros(b * t, hq, d)
    flat = flat.index_put((mask.index[mask.valid],), out.transpose(1, 2)[mask.valid])
    return flat.reshape(b, t, hq, d).transpose(1, 2)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, *, scale: float, causal: bool = False
) -> torch.Tensor:
    """Attention of ``q [B, Hq, T, D]`` over ``k, v [B, Hkv, S, D]`` (GQA when Hkv < Hq).

    ``mask``: a boolean tensor broadcastable to ``[B, Hq, T, S]`` (True = attend), a flex
    ``BlockMask``, a :class:`PackedTTTMask`, or None with ``causal`` (plain causal attention, requires T == S).
    Returns ``[B, Hq, T, D]``.
    """
    if isinstance(mask, PackedTTTMask):
        return _attend_packed(q, k, v, mask, scale)
    gqa = q.shape[1] != k.shape[1]
    if is_block_mask(mask):
        return _flex_kernel(q.device)(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:  # explicit repeat: every sdpa backend and torch version handles it
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal and q.shape[2] > 1, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask, cache: KVCache | None, *,
                  scale: float, window: int | None = None) -> torch.Tensor:
    """:func:`attend` of new queries ``q [B, Hq, T, D]`` over the cached keys/values followed by the new ``k, v
    [B, Hkv, T, D]`` (appended to ``cache``). ``attention_mask`` covers all keys (cached + new); None is causal, and
    with ``window`` also only the keys less than ``window`` positions back (a key's position is its index then)."""
    t = q.shape[2]
    past = 0
    if cache is not None:
        past = cache.length
        k, v = cache.append(k, v)  # (B, Hkv, S, D), S = past + T
    mask = attention_mask
    if mask is None and (past > 0 or window is not None):  # causal over cached + new keys
        keys = torch.arange(k.shape[2], device=q.device)[None, :]
        queries = (past + torch.arange(t, device=q.device))[:, None]
        mask = keys <= queries
        if window is not None:
            mask = mask & (queries - keys < window)
    if isinstance(mask, torch.Tensor) and mask.shape[-1] != k.shape[2]:
        raise ValueError(f"attention_mask covers {mask.shape[-1]} keys, but there are {k.shape[2]}")
    return attend(q, k, v, mask, scale=scale, causal=mask is None)


# ----------------------------------------------------------------------------------------------
# TTT masks
# ----------------------------------------------------------------------------------------------


def ttt_mask_dense(step: int, seq_len: int, document_ids: torch.Tensor | None = None, *, batch_size: int = 1,
                   device=None, window: int | None = None) -> torch.Tensor:
    """Boolean mask ``[B, 1, T, (step+1)*T]`` for the queries of TTT step ``step`` (True = attend).

    ``document_ids``: optional ``[B, T]`` ints; a query only sees step-0 keys of its own document. ``window``: a
    sliding-window draft's (module docstring).
    """
    t = seq_len
    if document_ids is not None:
        device = document_ids.device
        batch_size = document_ids.shape[0]
    q = torch.arange(t, device=device)
    causal = q[None, :] <= q[:, None]  # (T, T) key j <= query t
    if window is not None:
        causal = causal & (q[:, None] + step - q[None, :] < window)
    if document_ids is not None:
        same_doc = document_ids[:, :, None] == document_ids[:, None, :]  # (B, T, T)
        step0 = causal[None] & same_doc
    else:
        step0 = causal[None].expand(batch_size, t, t)
    blocks = [step0]
    if step > 0:
        eye = torch.eye(t, dtype=torch.bool, device=device)[None].expand(batch_size, t, t)
        blocks.extend(eye if window is None or step - i < window else torch.zeros_like(eye)
                      for i in range(1, step + 1))
    return torch.cat(blocks, dim=-1)[:, None]  # (B, 1, T, (step+1)T)


def ttt_mask_mod(seq_len: int, document_ids: torch.Tensor | None = None, step: int = 0, window: int | None = None):
    """The flex ``mask_mod(b, h, q_idx, kv_idx)`` of the TTT mask (keys laid out step-major; the queries' ``step``
    matters only with a ``window``)."""
    t = seq_len

    def mask_mod(b, h, q_idx, kv_idx):
        kv_step = kv_idx // t
        kv_pos = kv_idx % t
        causal = kv_pos <= q_idx
        if document_ids is not None:
            causal = causal & (document_ids[b, kv_pos] == document_ids[b, q_idx])
        diagonal = (kv_step > 0) & (kv_pos == q_idx)
        if window is not None:
            causal = causal & (q_idx + step - kv_pos < window)
            diagonal = diagonal & (step - kv_step < window)
        return ((kv_step == 0) & causal) | diagonal

    return mask_mod


def ttt_block_mask(step: int, seq_len: int, document_ids: torch.Tensor | None = None, *, batch_size: int = 1,
                   device=None, block_size: int = 128, window: int | None = None):
    """A flex ``BlockMask`` equal to :func:`ttt_mask_dense` for TTT step ``step``."""
    if not flex_available():
        raise RuntimeError("flex-attention needs torch >= 2.5; use attention='sdpa'")
    if document_ids is not None:
        device = document_ids.device
        batch_size = document_ids.shape[0]
    b = batch_size if document_ids is not None else None
    return create_block_mask(ttt_mask_mod(seq_len, document_ids, step, window), B=b, H=None, Q_LEN=seq_len,
                             KV_LEN=(step + 1) * seq_len, device=device, BLOCK_SIZE=block_size)
