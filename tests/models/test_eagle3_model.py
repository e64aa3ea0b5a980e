"""The draft computes vLLM's EAGLE-3 equations: pinned numbers, an independent re-derivation, KV cache, I/O."""

from __future__ import annotations

import json
import math

import pytest
import torch
from draft_fixtures import DRAFT_VOCAB, HIDDEN, VOCAB, fixed_init, tiny_kwargs, tiny_maps

from tiny_speculators.errors import UserError
from tiny_speculators.models.attention import KVCache
from tiny_speculators.models.checkpoint import save_draft
from tiny_speculators.models.eagle3 import Eagle3Draft
from tiny_speculators.models.eagle3.family import build_draft, draft_kwargs_from_verifier
from tiny_speculators.models.importing import load_draft


def _inputs(b=2, t=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    aux = torch.randn(b, t, 3 * HIDDEN, generator=g)
    pos = torch.arange(t)[None].expand(b, t) + torch.arange(b)[:, None]  # rows start at different positions
    return ids, aux, pos


# ------------------------------------------------------------------------------------------------
# An independent re-derivation of vLLM's llama_eagle3 forward, written from its equations only
# (no code shared with the model): per-head loops, explicit RoPE formula, explicit softmax.
# ------------------------------------------------------------------------------------------------

def _rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def reference_forward(sd: dict, kw: dict, ids, hidden, pos):
    """Returns (logits, fed_back_hidden) for one draft step with causal attention."""
    eps = kw["rms_norm_eps"]
    L = "layers.0."
    embeds = sd["embed_tokens.weight"][ids]
    # vLLM Eagle3 LlamaDecoderLayer (layer 0): embeds -> input_layernorm; hidden -> hidden_norm;
    # residual = hidden (or the normed hidden with norm_before_residual).
    e = _rms(embeds, sd[L + "input_layernorm.weight"], eps)
    hn = _rms(hidden, sd[L + "hidden_norm.weight"], eps)
    residual = hn if kw.get("norm_before_residual") else hidden
    x = torch.cat([e, hn], dim=-1)  # 2H into the qkv projection
    residual = _reference_attention(sd, kw, L, x, pos) + residual  # post_attention_layernorm's fused residual add
    out = _reference_mlp(sd, kw, L, _rms(residual, sd[L + "post_attention_layernorm.weight"], eps)) + residual
    for i in range(1, kw.get("num_layers", 1)):
        # later layers (vLLM's layer_idx > 0): input_layernorm(hidden, residual) on the H stream, no embeddings
        L = f"layers.{i}."
        out = out + _reference_attention(sd, kw, L, _rms(out, sd[L + "input_layernorm.weight"], eps), pos)
        out = out + _reference_mlp(sd, kw, L, _rms(out, sd[L + "post_attention_layernorm.weight"], eps))
    # LlamaModel.forward: norm(hidden, residual) -> (norm(m + residual), m + residual);
    # the eagle proposer samples from the first and feeds the second (pre-norm) back.
    logits = _rms(out, sd["norm.weight"], eps) @ sd["lm_head.weight"].T
    return logits, out


def _reference_mlp(sd, kw, L, xn):
    g = xn @ sd[L + "mlp.gate_proj.weight"].T
    u = xn @ sd[L + "mlp.up_proj.weight"].T
    return (g * torch.sigmoid(g) * u) @ sd[L + "mlp.down_proj.weight"].T


def _reference_attention(sd, kw, L, x, pos):
    """Layer ``L``'s causal self-attention output (o_proj included) on its input ``x``, head by head."""
    eps, nh, nkv, d = kw["rms_norm_eps"], kw["num_attention_heads"], kw["num_key_value_heads"], kw["head_dim"]
    theta = kw["rope_parameters"]["rope_theta"]
    q = x @ sd[L + "self_attn.q_proj.weight"].T
    k = x @ sd[L + "self_attn.k_proj.weight"].T
    v = x @ sd[L + "self_attn.v_proj.weight"].T
    if kw.get("attention_bias"):
        q = q + sd[L + "self_attn.q_proj.bias"]
        k = k + sd[L + "self_attn.k_proj.bias"]
        v = v + sd[L + "self_attn.v_proj.bias"]
    b, t, _ = x.shape
    out = torch.zeros(b, t, nh * d)
    for bi in range(b):
        for h in range(nh):
            kh = h // (nh // nkv)  # GQA: query head h reads kv head h // group
            qh = q[bi, :, h * d:(h + 1) * d]
            khh = k[bi, :, kh * d:(kh + 1) * d]
            vh = v[bi, :, kh * d:(kh + 1) * d]
            if kw.get("layer_type") == "qwen3":
                qh = _rms(qh, sd[L + "self_attn.q_norm.weight"], eps)
                khh = _rms(khh, sd[L + "self_attn.k_norm.weight"], eps)
            # neox RoPE: pair dim i with i + d/2, angle = pos * theta^(-2i/d)
            half = d // 2
            ang = pos[bi][:, None].double() * theta ** (-2.0 * torch.arange(half).double() / d)[None]
            c, s = ang.cos().float(), ang.sin().float()

            def rope(z, c=c, s=s, half=half):
                z1, z2 = z[:, :half], z[:, half:]
                return torch.cat([z1 * c - z2 * s, z2 * c + z1 * s], dim=-1)

            qr, kr = rope(qh), rope(khh)
            scores = qr @ kr.T / math.sqrt(d)
            scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
            out[bi, :, h * d:(h + 1) * d] = torch.softmax(scores, dim=-1) @ vh
    a = out @ sd[L + "self_attn.o_proj.weight"].T
    if kw.get("attention_bias") and kw.get("layer_type") != "qwen3":  # vLLM's Qwen3 o_proj has no bias
        a = a + sd[L + "self_attn.o_proj.bias"]
    return a


def reference_fuse(sd, kw, aux):
    eps = kw["rms_norm_eps"]
    if kw.get("norm_before_fc"):
        aux = _rms(aux, sd["input_norm.weight"], eps)
    if kw.get("fc_norm"):
        chunks = aux.chunk(kw["num_aux"], dim=-1)
        aux = torch.cat([_rms(c, sd[f"fc_norm.{i}.weight"], eps) for i, c in enumerate(chunks)], dim=-1)
    return aux @ sd["fc.weight"].T


VARIANTS = {
    "llama": {},
    "qwen3": {"layer_type": "qwen3"},
    "norm_before_residual": {"norm_before_residual": True},
    "fc_norms+bias": {"norm_before_fc": True, "fc_norm": True, "attention_bias": True},
    "3 layers": {"num_layers": 3, "norm_before_residual": True},
    "2 qwen3 layers": {"num_layers": 2, "layer_type": "qwen3"},
    "2 qwen3 layers+bias": {"num_layers": 2, "layer_type": "qwen3", "attention_bias": True},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_matches_vllm_equations(variant):
    kw = tiny_kwargs(**VARIANTS[variant])
    draft = fixed_init(Eagle3Draft(**kw))
    sd = {k: v.detach() for k, v in draft.state_dict().items()}
    ids, aux, pos = _inputs()
    with torch.no_grad():
        g = draft.fuse(aux)
        out = draft(ids, g, pos)
        ref_g = reference_fuse(sd, kw, aux)
        ref_logits, ref_hidden = reference_forward(sd, kw, ids, ref_g, pos)
        torch.testing.assert_close(g, ref_g, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.logits, ref_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.hidden_states, ref_hidden, atol=1e-5, rtol=1e-5)
        # second draft step: the fed-back hidden state is the pre-norm output, NOT norm(out)
        ids2 = torch.roll(ids, 1, dims=1)
        out2 = draft(ids2, out.hidden_states, pos + 1)
        ref2, _ = reference_forward(sd, kw, ids2, ref_hidden, pos + 1)
        torch.testing.assert_close(out2.logits, ref2, atol=1e-5, rtol=1e-5)
        wrong, _ = reference_forward(sd, kw, ids2, _rms(ref_hidden, sd["norm.weight"], kw["rms_norm_eps"]), pos + 1)
        assert (out2.logits - wrong).abs().max() > 1e-3


def test_fixed_init_forward_numbers(tiny_draft):
    ids = torch.tensor([[3, 17, 8, 31, 0, 22]])
    aux = torch.sin(torch.arange(6 * 3 * HIDDEN, dtype=torch.float32) * 0.37).view(1, 6, 3 * HIDDEN)
    pos = torch.arange(6)[None]
    with torch.no_grad():
        out = tiny_draft(ids, tiny_draft.fuse(aux), pos)
    got_logits = out.logits[0, :, :4]
    got_hidden = out.hidden_states[0, :, :4]
    expected_logits = torch.tensor(EXPECTED_LOGITS)
    expected_hidden = torch.tensor(EXPECTED_HIDDEN)
    torch.testing.assert_close(got_logits, expected_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_hidden, expected_hidden, atol=1e-4, rtol=1e-4)
    assert out.logits.argmax(-1).tolist() == [EXPECTED_ARGMAX]


# Pinned from this implementation after test_forward_matches_vllm_equations agreed with it (fp32, CPU).
EXPECTED_LOGITS = [[0.31383, -0.73405, 1.07256, -1.29166], [-0.55346, 0.6865, -0.74312, 0.717],
                   [-0.58562, 0.83759, -0.99632, 1.04412], [-0.85312, 0.45246, -0.00142, -0.44977],
                   [-0.77013, 0.21733, 0.35967, -0.89662], [0.05346, 0.39348, -0.79662, 1.11107]]
EXPECTED_HIDDEN = [[-0.09036, 0.51165, 1.01114, 0.66436], [0.06998, -0.21348, -0.02224, -0.3978],
                   [0.14223, -0.19095, -0.20655, -0.25781], [0.37431, 0.31348, -0.04786, 0.07214],
                   [1.22281, 1.49439, 0.73154, 0.20353], [-0.11188, -0.0403, -0.1452, -0.1373]]
EXPECTED_ARGMAX = [4, 21, 3, 6, 6, 14]


@pytest.mark.parametrize("num_layers", [1, 2])
def test_kv_cache_incremental_equals_full(num_layers):
    tiny_draft = fixed_init(Eagle3Draft(**tiny_kwargs(num_layers=num_layers)))
    ids, aux, pos = _inputs(b=2, t=9, seed=3)
    with torch.no_grad():
        h = tiny_draft.fuse(aux)
        full = tiny_draft(ids, h, pos)
        cache = KVCache()
        a = tiny_draft(ids[:, :4], h[:, :4], pos[:, :4], cache=cache)
        assert cache.length == 4
        b = tiny_draft(ids[:, 4:5], h[:, 4:5], pos[:, 4:5], cache=cache)
        # speculative branch that gets rejected: append 3 junk positions, then roll back
        tiny_draft(ids[:, :3], h[:, :3] * 2, pos[:, 5:8], cache=cache)
        assert cache.length == 8
        cache.crop(5)
        c = tiny_draft(ids[:, 5:], h[:, 5:], pos[:, 5:], cache=cache)
        assert cache.length == 9
        assert [c.length for c in cache.later] == [9] * (num_layers - 1)  # every layer was rolled back too
    inc = torch.cat([a.logits, b.logits, c.logits], dim=1)
    torch.testing.assert_close(inc, full.logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        cache.crop(10)


def test_explicit_mask_equals_causal(tiny_draft):
    ids, aux, pos = _inputs(b=1, t=6)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        h = tiny_draft.fuse(aux)
        torch.testing.assert_close(tiny_draft(ids, h, pos, attention_mask=mask).logits,
                                   tiny_draft(ids, h, pos).logits)


def test_to_target_ids(tiny_draft):
    _, t2d = tiny_maps()
    draft_ids = torch.arange(DRAFT_VOCAB)
    assert torch.equal(tiny_draft.to_target_ids(draft_ids), torch.nonzero(t2d).flatten())


def test_builder_from_verifier_and_lm_head_rows(tiny_llama_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(tiny_llama_dir)
    verifier = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    vocab = cfg.vocab_size
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.arange(0, vocab, 7)] = True
    n = int(t2d.sum())
    d2t = torch.nonzero(t2d).flatten() - torch.arange(n)
    kw = draft_kwargs_from_verifier(cfg, n, norm_before_residual=True)
    assert kw["head_dim"] == 32 and kw["num_key_value_heads"] == 1 and kw["hidden_size"] == 64
    assert kw["rope_parameters"]["rope_type"] == "default"
    draft = build_draft(kw, d2t, t2d, embed_weight=verifier.get_input_embeddings().weight,
                        lm_head_weight=verifier.get_output_embeddings().weight)
    assert torch.equal(draft.embed_tokens.weight, verifier.get_input_embeddings().weight)
    assert not draft.embed_tokens.weight.requires_grad
    assert torch.equal(draft.lm_head.weight, verifier.get_output_embeddings().weight[t2d])
    with pytest.raises(UserError):
        draft_kwargs_from_verifier(cfg, n, bogus=1)
    with pytest.raises(UserError):
        build_draft(kw, torch.roll(d2t, 1), t2d)


def test_llama3_rope_scaling_builds():
    cfg = {"hidden_size": 16, "num_attention_heads": 2, "vocab_size": 40, "intermediate_size": 32,
           "max_position_embeddings": 131072, "rope_theta": 500000.0,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}}
    kw = draft_kwargs_from_verifier(cfg, 24)
    assert kw["rope_parameters"]["rope_type"] == "llama3" and kw["rope_parameters"]["rope_theta"] == 500000.0
    draft = Eagle3Draft(**kw)
    plain = Eagle3Draft(**{**kw, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
    # llama3 scaling leaves high frequencies alone and divides the lowest by `factor`
    assert torch.isclose(draft.rotary.inv_freq[0], plain.rotary.inv_freq[0])
    assert torch.isclose(draft.rotary.inv_freq[-1], plain.rotary.inv_freq[-1] / 8.0)


@pytest.mark.parametrize("rope_scaling", [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
], ids=["default", "linear", "llama3", "yarn"])
def test_rope_matches_hugging_face(rope_scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32, max_position_embeddings=256,
                      rope_theta=5e5, rope_scaling=rope_scaling)
    kw = draft_kwargs_from_verifier(cfg, 10)
    ours = Eagle3Draft(**{**kw, "vocab_size": 20, "intermediate_size": 8}).rotary
    pos = torch.arange(200)[None]
    cos, sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, 200, 64), pos)
    got_cos, got_sin = ours(pos, torch.float32)
    torch.testing.assert_close(got_cos, cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(got_sin, sin, atol=1e-6, rtol=0)


def test_save_load_round_trip(tmp_path, tiny_draft):
    meta = {"aux_layer_ids": [2, 4, 5], "verifier": {"name_or_path": "x", "architectures": ["LlamaForCausalLM"],
                                                     "hidden_size": HIDDEN, "vocab_size": VOCAB}}
    save_draft(tmp_path / "ckpt", tiny_draft, meta)
    loaded, config = load_draft(tmp_path / "ckpt")
    assert config["model_type"] == "eagle3" and config["aux_layer_ids"] == [2, 4, 5]
    assert json.loads((tmp_path / "ckpt" / "draft_config.json").read_text())["kwargs"] == tiny_draft.kwargs
    for (k1, v1), (k2, v2) in zip(tiny_draft.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert k1 == k2 and v1.dtype == v2.dtype and torch.equal(v1, v2)
    ids, aux, pos = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, loaded.fuse(aux), pos).logits,
                                   tiny_draft(ids, tiny_draft.fuse(aux), pos).logits, atol=0, rtol=0)
    assert not loaded.embed_tokens.weight.requires_grad and loaded.fc.weight.requires_grad
    half, _ = load_draft(tmp_path / "ckpt", dtype=torch.bfloat16)
    assert half.fc.weight.dtype == torch.bfloat16 and half.d2t.dtype == torch.long and half.t2d.dtype == torch.bool
    with pytest.raises(UserError):
        load_draft(tmp_path / "missing")


def test_norm_output_feeds_back_the_post_norm_state():
    """speculators' ``norm_output`` (its EAGLE-3 default): same logits as the pre-norm draft, but the state it
    returns and feeds back is ``norm(h)``; the flag survives the speculators format both ways."""
    from tiny_speculators.models.eagle3.speculators import draft_kwargs, speculators_config

    kw = tiny_kwargs(norm_before_fc=True)
    plain = fixed_init(Eagle3Draft(**kw))
    normed = Eagle3Draft(**{**kw, "norm_output": True})
    normed.load_state_dict(plain.state_dict())
    sd = {k: v.detach() for k, v in plain.state_dict().items()}
    eps = kw["rms_norm_eps"]
    ids, aux, pos = _inputs()
    with torch.no_grad():
        g = normed.fuse(aux)
        out = normed(ids, g, pos)
        ref_logits, ref_prenorm = reference_forward(sd, kw, ids, reference_fuse(sd, kw, aux), pos)
        torch.testing.assert_close(out.logits, ref_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.hidden_states, _rms(ref_prenorm, sd["norm.weight"], eps), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(normed.compute_logits(out.hidden_states), ref_logits, atol=1e-5, rtol=1e-5)
        ids2 = torch.roll(ids, 1, dims=1)
        out2 = normed(ids2, out.hidden_states, pos + 1)
        ref2, _ = reference_forward(sd, kw, ids2, _rms(ref_prenorm, sd["norm.weight"], eps), pos + 1)
        torch.testing.assert_close(out2.logits, ref2, atol=1e-5, rtol=1e-5)
    cfg = speculators_config(normed.kwargs, aux_layer_ids=[2, 4, 5], verifier={"name_or_path": "x"})
    assert cfg["norm_output"] is True and draft_kwargs(cfg)["norm_output"] is True
    assert draft_kwargs(speculators_config(plain.kwargs, aux_layer_ids=None, verifier={"name_or_path": "x"}))[
        "norm_output"] is False
