"""Full-precision weights out of a quantized checkpoint's tensors, for the few verifier weights a draft copies
(embeddings, lm_head rows, the final norm, a decoder layer to start from).

A quantized verifier runs only in vLLM, but the draft is trained in full precision: its copies must be the
verifier's weights as the quantized checkpoint defines them, ``(q - zero_point) * scale``. Stored forms read:

- compressed-tensors ``pack-quantized`` (LLM Compressor's W4A16 / W8A16, GPTQ/AWQ-style INT4): ``X.weight_packed``
  (int32, values packed along the input dim, offset by half the range), ``X.weight_shape``, ``X.weight_scale``
  (per channel or per input group), optional ``X.weight_zero_point`` (packed along the output dim);
- compressed-tensors ``int-quantized`` / ``float-quantized`` (W8A8 INT8 or FP8): ``X.weight`` in int8 or fp8 with
  ``X.weight_scale`` (per tensor, channel or group), optional ``X.weight_zero_point``;
- DeepSeek-V3 / Kimi-K2 FP8: ``X.weight`` in fp8 with ``X.weight_scale_inv`` per 128 x 128 block.

    index = safetensor_index(folder)     # lists "X.weight" for a packed "X.weight_packed" too
    read_tensors(index, ["lm_head.weight"])["lm_head.weight"]   # dequantized, fp32
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tiny_speculators.errors import UserError

__all__ = ["COMPANIONS", "PACKED", "QUANTIZED_DTYPES", "dequantize", "unpack_int32"]

PACKED = "weight_packed"
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
SCALES = ("weight_scale", "weight_scale_inv")
COMPANIONS = (PACKED, "weight_shape", *SCALES, "weight_zero_point", "weight_g_idx")  # read into X.weight


def unpack_int32(packed: torch.Tensor, num_bits: int, size: int, dim: int) -> torch.Tensor:
    """Signed values packed ``32 // num_bits`` per int32 along ``dim`` (lowest bits first), cut to ``size``."""
    per_word, mask = 32 // num_bits, (1 << num_bits) - 1
    packed = packed.to(torch.int32).movedim(dim, -1)
    parts = [(packed >> (num_bits * i)) & mask for i in range(per_word)]
    values = torch.stack(parts, dim=-1).flatten(-2)[..., :size]
    return (values - (1 << (num_bits - 1))).movedim(-1, dim)


def _bits(packed_cols: int, size: int) -> int:
    """The bit width whose packing turns ``size`` values into ``packed_cols`` int32 words."""
    for bits in (4, 8, 2, 1, 3, 5, 6, 7):
        if -(-size // (32 // bits)) == packed_cols:
            return bits
    raise UserError(f"cannot tell the bit width of {packed_cols} packed words holding {size} values")


def _block(size: int, blocks: int) -> int:
    """The block (group) length that cuts ``size`` into ``blocks``, the last one possibly partial: the power of two
    that does (groups and DeepSeek's 128-blocks are), else ``size / blocks``."""
    length = 1
    while -(-size // length) > blocks:
        length *= 2
    return length if -(-size // length) == blocks else -(-size // blocks)


def _broadcast(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A per-tensor, per-channel, per-group or per-block parameter repeated to the weight's ``shape``."""
    t = t.float().reshape(1, 1) if t.numel() == 1 else t.float()
    for dim, size in enumerate(shape):
        if t.shape[dim] != size:
            t = t.repeat_interleave(_block(size, t.shape[dim]), dim=dim).narrow(dim, 0, size)
    return t


def dequantize(name: str, get: Callable[[str], torch.Tensor | None]) -> torch.Tensor | None:
    """Weight ``name`` (``X.weight``) in fp32 from its quantized form, fetched by ``get`` (None when absent); None
    when the checkpoint stores it unquantized."""
    prefix = name.removesuffix("weight")
    packed = get(prefix + PACKED)
    if packed is not None:
        shape = get(prefix + "weight_shape")
        if shape is None:
            raise UserError(f"quantized weight {prefix + PACKED} has no {prefix}weight_shape beside it")
        in_features = int(shape.tolist()[-1])
        bits = _bits(packed.shape[1], in_features)
        q = unpack_int32(packed, bits, in_features, dim=1)
    else:
        q = get(name)
        if q is None or q.dtype not in QUANTIZED_DTYPES:
            return None
        bits = 8
    scale = next((s for s in map(get, (prefix + key for key in SCALES)) if s is not None), None)
    if scale is None:
        raise UserError(f"quantized weight {name} ({q.dtype}) has no {prefix}weight_scale beside it")
    zero_point = get(prefix + "weight_zero_point")
    w = q.float()
    if zero_point is not None and zero_point.numel():
        if zero_point.dtype == torch.int32 and packed is not None:  # packed along the output dim
            zero_point = unpack_int32(zero_point, bits, q.shape[0], dim=0)
        w = w - _broadcast(zero_point, q.shape)
    return w * _broadcast(scale, q.shape)
