"""Quantized checkpoints' weights read back in full precision, ``(q - zero_point) * scale``, through the same
``safetensor_index`` / ``read_tensors`` every stage uses. The stored layouts are written here by hand from their
definitions; ``tests/export/test_vllm_quantized.py`` checks the same reads against checkpoints that
compressed-tensors itself wrote."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tiny_speculators.errors import UserError
from tiny_speculators.verifier.dequantize import unpack_int32
from tiny_speculators.verifier.describe import read_prefixed, read_tensors, safetensor_index


def pack_int32(q: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Signed ``q`` offset by half the range, ``32 // bits`` values per int32 along ``dim``, lowest bits first."""
    per_word = 32 // bits
    u = (q + (1 << (bits - 1))).to(torch.int64).movedim(dim, -1)
    u = torch.nn.functional.pad(u, (0, -u.shape[-1] % per_word)).unflatten(-1, (-1, per_word))
    words = (u << (torch.arange(per_word) * bits)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).movedim(-1, dim).contiguous()


def test_unpacking_inverts_packing_for_each_width():
    torch.manual_seed(0)
    for bits in (2, 4, 8):
        q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (6, 40))
        for dim in (0, 1):
            assert torch.equal(unpack_int32(pack_int32(q, bits, dim), bits, q.shape[dim], dim), q)


def test_a_pack_quantized_group_weight_reads_dequantized(tmp_path):
    torch.manual_seed(1)
    q = torch.randint(-8, 8, (96, 64))
    scale = torch.rand(96, 2) + 0.1  # groups of 32 input columns
    zero_point = torch.randint(-3, 3, (96, 2))
    save_file({"lm_head.weight_packed": pack_int32(q, 4, 1), "lm_head.weight_shape": torch.tensor([96, 64]),
               "lm_head.weight_scale": scale, "lm_head.weight_zero_point": pack_int32(zero_point, 4, 0),
               "model.norm.weight": torch.ones(64)}, tmp_path / "model.safetensors")
    index = safetensor_index(tmp_path)
    assert "lm_head.weight" in index  # listed beside the packed form
    got = read_tensors(index, ["lm_head.weight", "model.norm.weight"])
    expected = (q - zero_point.repeat_interleave(32, 1)).float() * scale.repeat_interleave(32, 1)
    torch.testing.assert_close(got["lm_head.weight"], expected, rtol=0, atol=0)
    assert torch.equal(got["model.norm.weight"], torch.ones(64))


def test_int8_channel_and_fp8_block_weights_read_dequantized(tmp_path):
    torch.manual_seed(2)
    q8 = torch.randint(-128, 128, (64, 32), dtype=torch.int8)
    channel = torch.rand(64, 1)
    fp8 = (torch.randn(256, 160) * 8).to(torch.float8_e4m3fn)
    blocks = torch.rand(2, 2)  # DeepSeek-V3's 128 x 128 weight_scale_inv, the last block partial
    save_file({"a.weight": q8, "a.weight_scale": channel, "b.weight": fp8, "b.weight_scale_inv": blocks},
              tmp_path / "model.safetensors")
    got = read_tensors(safetensor_index(tmp_path), ["a.weight", "b.weight"])
    torch.testing.assert_close(got["a.weight"], q8.float() * channel, rtol=0, atol=0)
    expected = fp8.float() * blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)[:, :160]
    torch.testing.assert_close(got["b.weight"], expected, rtol=0, atol=0)


def test_a_layer_read_by_prefix_holds_weights_not_their_parts(tmp_path):
    q = torch.randint(-8, 8, (32, 32))
    save_file({"layers.1.up.weight_packed": pack_int32(q, 4, 1), "layers.1.up.weight_shape": torch.tensor([32, 32]),
               "layers.1.up.weight_scale": torch.full((32, 1), 0.5), "layers.1.norm.weight": torch.ones(32)},
              tmp_path / "model.safetensors")
    state = read_prefixed(tmp_path, "layers.1.")
    assert sorted(state) == ["norm.weight", "up.weight"]
    torch.testing.assert_close(state["up.weight"], q.float() * 0.5, rtol=0, atol=0)


def test_a_quantized_weight_without_its_scale_fails_in_one_line(tmp_path):
    save_file({"w.weight": torch.zeros(4, 4, dtype=torch.int8)}, tmp_path / "model.safetensors")
    with pytest.raises(UserError, match=r"^quantized weight w\.weight \(torch\.int8\) has no w\.weight_scale"):
        read_tensors(safetensor_index(tmp_path), ["w.weight"])
