"""Shards, manifest merging and the verifying reader, on synthetic hidden states (no model needed)."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

from tiny_speculators.errors import UserError
from tiny_speculators.storage.layout import Layout, bytes_per_token, dequantize_fp8, quantize_fp8
from tiny_speculators.storage.manifest import (
    MANIFEST,
    PLAN,
    init_plan,
    load_manifest,
    merge_manifest,
    write_bytes_atomic,
)
from tiny_speculators.storage.reader import HiddenStateReader, verify_extraction
from tiny_speculators.storage.shards import ShardWriter

H, N_AUX, K = 8, 3, 4


def _settings(layout: str, dtype: str = "float32") -> dict:
    return {"verifier": "synthetic", "verifier_id": "synthetic", "verifier_revision": None, "architectures": [],
            "aux_layer_ids": [2, 4, 5], "num_hidden_layers": 8, "hidden_size": H, "vocab_size": 100,
            "dtype": dtype, "layout": layout, "topk": K if layout.endswith("topk") else None}


def _samples(lengths, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        out.append({"input_ids": torch.randint(0, 100, (n,), generator=g), "loss_mask": torch.randint(0, 2, (n,),
                    generator=g).to(torch.uint8), "aux": torch.randn(n, N_AUX * H, generator=g).to(dtype),
                    "last": torch.randn(n, H, generator=g).to(dtype),
                    "topk_ids": torch.randint(0, 100, (n, K), generator=g),
                    "topk_logits": torch.randn(n, K, generator=g), "logsumexp": torch.randn(n, generator=g)})
    return out


def _write(out, layout="full", shards=((0, [3, 5]), (1, [2]), (2, [4, 1, 6])), ranks=1, dtype="float32"):
    """Write ``shards`` (index, sample lengths) with shard k by rank k % ranks; returns the samples by index."""
    plan, start, all_samples = [], 0, []
    for _, lengths in shards:
        plan.append({"start": start, "end": start + len(lengths), "tokens": sum(lengths)})
        start += len(lengths)
    init_plan(out, _settings(layout, dtype), plan)
    store = Layout.parse(layout, K)
    writers = [ShardWriter(out, r, store, N_AUX) for r in range(ranks)]
    for (k, lengths), p in zip(shards, plan, strict=True):
        samples = _samples(lengths, seed=k, dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32)
        writers[k % ranks].submit(k, p["start"], p["end"], samples)
        all_samples.extend(samples)
    for w in writers:
        w.close()
    return all_samples


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_roundtrip_full(tmp_path, dtype):
    samples = _write(tmp_path, dtype=dtype)
    assert merge_manifest(tmp_path) is not None
    reader = HiddenStateReader(tmp_path)
    assert len(reader) == 6 and reader.manifest["tokens"] == 21 and reader.lengths() == [3, 5, 2, 4, 1, 6]
    for i, ref in enumerate(samples):
        got = reader[i]
        assert got["input_ids"].dtype == torch.long and torch.equal(got["input_ids"], ref["input_ids"])
        assert torch.equal(got["loss_mask"], ref["loss_mask"].long())
        assert torch.equal(got["aux_hidden_states"], ref["aux"]) and torch.equal(got["last_hidden_state"], ref["last"])
        assert got["aux_hidden_states"].dtype == ref["aux"].dtype
    assert torch.equal(reader[-1]["input_ids"], samples[-1]["input_ids"])
    assert list(reader.token_columns()) == [(s["input_ids"].tolist(), s["loss_mask"].long().tolist()) for s in samples]
    with pytest.raises(IndexError):
        reader[6]
    report = verify_extraction(tmp_path)
    assert report["ok"] and report["shards"] == 3


def test_fp8_topk_layout(tmp_path):
    samples = _write(tmp_path, layout="fp8-topk")
    merge_manifest(tmp_path)
    reader = HiddenStateReader(tmp_path)
    for i, ref in enumerate(samples):
        got = reader[i]
        assert "last_hidden_state" not in got and got["aux_hidden_states"].dtype == torch.float32
        err = (got["aux_hidden_states"] - ref["aux"]).abs()
        scale = ref["aux"].reshape(-1, N_AUX, H).abs().amax(-1).repeat_interleave(H, dim=-1)
        assert bool((err <= scale * 2**-4 + 1e-12).all())  # e4m3: 3 mantissa bits
        assert torch.equal(got["target_topk_ids"], ref["topk_ids"])
        assert torch.equal(got["target_topk_logits"], ref["topk_logits"])
        assert torch.equal(got["target_logsumexp"], ref["logsumexp"])


def test_fp8_quantization_per_token_scale():
    x = torch.randn(5, N_AUX * H) * torch.tensor([1e-3, 1.0, 1e3, 5.0, 0.0])[:, None]
    q, scales = quantize_fp8(x, N_AUX)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (5, N_AUX)
    back = dequantize_fp8(q, scales)
    rel = (back - x).abs().amax(-1) / x.abs().amax(-1).clamp_min(1e-30)
    assert bool((rel[:4] < 0.07).all()) and torch.equal(back[4], x[4])


def test_bytes_per_token():
    full = bytes_per_token(Layout.parse("full"), 3, 4096, "bfloat16")
    assert full == 5 + 4 * 4096 * 2
    assert bytes_per_token(Layout.parse("fp8"), 3, 4096, "bfloat16") == 5 + 3 * 4096 + 12 + 4096 * 2
    assert bytes_per_token(Layout.parse("fp8-topk", 64), 3, 4096, "bfloat16") == 5 + 3 * 4096 + 12 + 64 * 8 + 4
    with pytest.raises(UserError, match="unknown storage layout"):
        Layout.parse("int4")


def test_two_ranks_merge_and_incomplete_view(tmp_path):
    _write(tmp_path, ranks=2)
    parts = sorted(p.name for p in (tmp_path / "parts").iterdir())
    assert parts == ["rank-00000.json", "rank-00001.json"]
    assert not (tmp_path / MANIFEST).exists()
    view = load_manifest(tmp_path)  # merged from parts without manifest.json
    assert [s["index"] for s in view["shards"]] == [0, 1, 2] and view["samples"] == 6
    assert merge_manifest(tmp_path) == view
    # a missing part makes the extraction incomplete: a clear error, not a short dataset
    (tmp_path / MANIFEST).unlink()
    (tmp_path / "parts" / "rank-00001.json").unlink()
    with pytest.raises(UserError, match=r"incomplete: 1 of 3 shards missing \(1\)"):
        HiddenStateReader(tmp_path)


def _flip_byte(path, offset_from_end=10):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupted_shard_is_detected(tmp_path):
    _write(tmp_path)
    merge_manifest(tmp_path)
    _flip_byte(tmp_path / "shard-00001.safetensors")
    reader = HiddenStateReader(tmp_path)
    reader[0]  # shard 0 is fine
    assert reader.lengths() == [3, 5, 2, 4, 1, 6]  # offsets only; the data's checksum is checked on first read
    with pytest.raises(UserError, match=r"shard-00001.safetensors is corrupted: sha256"):
        reader[2]
    report = verify_extraction(tmp_path)
    assert not report["ok"] and len(report["problems"]) == 1 and "shard-00001" in report["problems"][0]
    # without checksum verification a damaged header is still an error, never silent data
    path = tmp_path / "shard-00002.safetensors"
    path.write_bytes(b"\x00" * 40)
    with pytest.raises(UserError, match="shard-00002.safetensors is unreadable"):
        HiddenStateReader(tmp_path, verify=False)[5]


def test_verify_share_checks_only_its_shards(tmp_path):
    """Ranks split one checksum pass: shares (r, w) are disjoint, cover every shard, and report whole counts."""
    _write(tmp_path)
    merge_manifest(tmp_path)
    _flip_byte(tmp_path / "shard-00001.safetensors")
    reports = [verify_extraction(tmp_path, share=(r, 2)) for r in range(2)]
    assert reports[0]["ok"] and reports[0]["samples"] == 6 and reports[0]["shards"] == 3  # shards 0 and 2
    assert not reports[1]["ok"] and len(reports[1]["problems"]) == 1 and "shard-00001" in reports[1]["problems"][0]


def test_wrong_shapes_are_detected(tmp_path):
    _write(tmp_path)
    manifest = merge_manifest(tmp_path)
    manifest["hidden_size"] = H + 1
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=r"tensor aux_hidden_states is float32 \[8, 24\], expected float32 \[8, 27\]"):
        HiddenStateReader(tmp_path)[0]


def test_changed_settings_are_refused(tmp_path):
    _write(tmp_path)
    with pytest.raises(UserError, match=r"different settings \(dtype: 'float32' there, 'bfloat16' now\)"):
        init_plan(tmp_path, _settings("full", "bfloat16"), json.loads((tmp_path / PLAN).read_text())["shards"])


def test_disk_full_is_a_user_error(tmp_path, monkeypatch):
    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(UserError, match="disk full while writing .*x.bin"):
        write_bytes_atomic(tmp_path / "x.bin", b"abc")
    assert list(tmp_path.iterdir()) == []  # no temp file left behind
