"""MTP: the layer's forward pinned to a float64 re-derivation of vLLM's ``mimo_mtp.py`` and to fixed numbers, the
K-step training rollout equal to the chained inference it trains for, reading the verifier's MTP weights (MiMo
layout; errors for none and for a layout the config does not describe), the normalized step weights, the stitched
export. The DeepSeek-V3 layout: ``test_mtp_deepseek.py``.

    pytest -q tests/models/test_mtp.py
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from torch.nn import functional as F

from tiny_speculators.errors import UserError
from tiny_speculators.models.attention import KVCache
from tiny_speculators.models.mtp.model import MTPDraft

KW = dict(vocab_size=40, hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
          intermediate_size=32, num_hidden_layers=4, rms_norm_eps=1e-6,
          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=64, qkv_bias=True)


@torch.no_grad()
def fixed_mtp(**overrides) -> MTPDraft:
    """Deterministic weights: a sine pattern per parameter (norms around 1)."""
    draft = MTPDraft(**{**KW, **overrides})
    for i, (name, p) in enumerate(sorted(draft.named_parameters())):
        n = torch.arange(p.numel(), dtype=torch.float64)
        if name.endswith("norm.weight"):
            values = 1.0 + 0.5 * torch.sin(n * 1.3 + i)
        else:
            values = torch.sin(n * 0.61 + i) * (0.5 / math.sqrt(p.shape[-1]))
        p.copy_(values.view_as(p).to(p.dtype))
    return draft


def reference(w: dict[str, torch.Tensor], ids: torch.Tensor, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """vLLM's MiMoMultiTokenPredictorLayer + lm_head, in float64, causal over one sequence: logits [T, V]."""
    w = {k: v.double() for k, v in w.items()}
    eps, nh, nkv, d = KW["rms_norm_eps"], KW["num_attention_heads"], KW["num_key_value_heads"], KW["head_dim"]

    def rms(x, weight):
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    e = w["embed_tokens.weight"][ids]
    e[pos == 0] = 0.0  # vLLM: masking inputs at position 0
    u = torch.cat([rms(h.double(), w["hidden_layernorm.weight"]), rms(e, w["token_layernorm.weight"])], -1)
    u = u @ w["input_proj.weight"].T  # (T, H)
    x = rms(u, w["input_layernorm.weight"])
    t = ids.numel()
    q = (x @ w["self_attn.q_proj.weight"].T + w["self_attn.q_proj.bias"]).view(t, nh, d)
    k = (x @ w["self_attn.k_proj.weight"].T + w["self_attn.k_proj.bias"]).view(t, nkv, d)
    v = (x @ w["self_attn.v_proj.weight"].T + w["self_attn.v_proj.bias"]).view(t, nkv, d)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos.double()[:, None] * inv  # (T, D/2)
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]

    def rope(z):
        z1, z2 = z[..., : d // 2], z[..., d // 2:]
        return z * cos + torch.cat([-z2, z1], -1) * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, nh * d)
    r = u + attn @ w["self_attn.o_proj.weight"].T
    m = rms(r, w["post_attention_layernorm.weight"])
    mlp = (F.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    y = rms(r + mlp, w["final_layernorm.weight"])
    return y @ w["lm_head.weight"].T


def test_forward_matches_vllm_equations_in_float64_and_fixed_numbers():
    draft = fixed_mtp()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, KW["vocab_size"], (6,), generator=g)
    h = torch.randn(6, KW["hidden_size"], generator=g)
    pos = torch.arange(6)
    out = draft(ids[None], draft.fuse(h[None]), pos[None])
    torch.testing.assert_close(out.logits[0].double(), reference(draft.state_dict(), ids, h, pos), atol=2e-6, rtol=0)
    # the returned hidden state is after final_layernorm (vLLM feeds it back), and logits = lm_head(it)
    torch.testing.assert_close(out.logits, draft.lm_head(out.hidden_states))
    expected = torch.tensor([-0.4558485, 0.0854801, 0.2944044, -0.6415142, 0.9172071])  # measured on this init
    torch.testing.assert_close(out.logits[0, -1, :5], expected, atol=1e-6, rtol=0)
    # position 0 ignores its token (embedding zeroed); position 1 does not
    other = ids.clone()
    other[0], other[1] = (ids[0] + 1) % 40, (ids[1] + 1) % 40
    logits2 = draft(other[None], draft.fuse(h[None]), pos[None]).logits
    assert torch.equal(logits2[0, 0], out.logits[0, 0]) and not torch.allclose(logits2[0, 1], out.logits[0, 1])


def test_training_rollout_equals_chained_inference():
    """Step k of the K-step rollout at anchor t == vLLM's chain: prefill the verified slots, then feed the layer's
    own output with the next token at the next position (teacher-forced tokens)."""
    from tiny_speculators.models.ttt import rollout

    draft = fixed_mtp().eval()
    g = torch.Generator().manual_seed(1)
    t_len, steps = 12, 3
    ids = torch.randint(0, KW["vocab_size"], (1, t_len), generator=g)
    last = torch.randn(1, t_len, KW["hidden_size"], generator=g)
    pos = torch.arange(t_len)[None]
    with torch.no_grad():
        outs = rollout(draft, ids, last, pos, steps=steps)
        for anchor in (0, 4, 8):
            cache = KVCache()
            shifted = ids[:, 1: anchor + 2]  # x_{p+1} at slot p
            y = draft(shifted, draft.fuse(last[:, : anchor + 1]), pos[:, : anchor + 1], cache=cache).hidden_states
            y = y[:, -1:]
            torch.testing.assert_close(y[0, 0], outs[0][0, anchor], atol=5e-6, rtol=0)
            for k in range(1, steps):
                y = draft(ids[:, anchor + k + 1: anchor + k + 2], y, pos[:, anchor + k: anchor + k + 1],
                          cache=cache).hidden_states
                torch.testing.assert_close(y[0, 0], outs[k][0, anchor], atol=5e-6, rtol=0)  # fp32 order


def test_proposer_chains_the_one_layer():
    from tiny_speculators.models.mtp.proposer import MTPProposer
    from tiny_speculators.sampling import SamplingParams

    draft = fixed_mtp().eval()
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, KW["vocab_size"], (7,), generator=g).tolist()
    last = torch.randn(7, KW["hidden_size"], generator=g)
    proposer = MTPProposer(draft)
    proposer.commit(tokens, last, 0)
    proposed, _ = proposer.propose_chain(3, SamplingParams(), None)
    with torch.no_grad():  # by hand: one prefill, then two chained steps on the drafted tokens
        cache = KVCache()
        out = draft(torch.tensor([tokens]), last[None], torch.arange(7)[None], cache=cache)
        y, want = out.hidden_states[:, -1:], [int(out.logits[0, -1].argmax())]
        for i in range(2):
            out = draft(torch.tensor([[want[-1]]]), y, torch.tensor([[7 + i]]), cache=cache)
            y = out.hidden_states
            want.append(int(out.logits[0, -1].argmax()))
    assert proposed == want and proposer.draft_forwards == 3 and not proposer.supports_tree


def test_objective_weights_are_normalized_and_topk_batches_are_refused():
    from tiny_speculators.models.mtp.objective import MTPObjective
    from tiny_speculators.models.ttt import ttt_step

    draft = fixed_mtp()
    head = torch.nn.Linear(KW["hidden_size"], KW["vocab_size"], bias=False)
    g = torch.Generator().manual_seed(3)
    batch = {"input_ids": torch.randint(0, 40, (2, 10), generator=g), "loss_mask": torch.ones(2, 10),
             "last_hidden_state": torch.randn(2, 10, 16, generator=g), "position_ids": torch.arange(10).expand(2, 10)}
    objective = MTPObjective(draft, head, steps=3, beta=0.6, attention="sdpa")
    out = objective(batch)
    raw = ttt_step(draft, input_ids=batch["input_ids"], aux_hidden_states=batch["last_hidden_state"],
                   loss_mask=batch["loss_mask"], last_hidden_state=batch["last_hidden_state"], target_head=head,
                   steps=3, decay=0.6)
    assert out.loss.item() == pytest.approx(raw.loss.item() / (1 + 0.6 + 0.36), rel=1e-6)
    sums = raw.metrics["loss_sum"] / raw.metrics["count"]
    assert objective.summarize(out.metrics)["loss"] == pytest.approx(
        float((torch.tensor([1, 0.6, 0.36]) * sums).sum() / 1.96), rel=1e-5)
    with pytest.raises(UserError, match="top-k extract layouts drop: extract with --layout full or fp8"):
        objective({k: v for k, v in batch.items() if k != "last_hidden_state"})


def _inputs(path, config, **kw):
    from tiny_speculators.models.family import BuildInputs

    vocab = config.vocab_size
    return BuildInputs(verifier_config=config, d2t=torch.zeros(vocab, dtype=torch.long),
                       t2d=torch.ones(vocab, dtype=torch.bool), aux_layer_ids=[2], verifier_path=str(path), **kw)


def test_build_reads_the_verifiers_mimo_layer(tiny_mimo_dir):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from tiny_speculators.models import get_family

    family = get_family("mtp")
    draft = family.build(_inputs(tiny_mimo_dir, AutoConfig.from_pretrained(tiny_mimo_dir)), family.options())
    state = load_file(str(tiny_mimo_dir / "model.safetensors"))
    layer = draft.layer_state()
    assert len(layer) == 16 and draft.kwargs["aux_layer_ids"] == [8]
    for name, value in layer.items():
        assert torch.equal(value, state[f"model.mtp_layers.0.{name}"]), name
    assert torch.equal(draft.embed_tokens.weight, state["model.embed_tokens.weight"])
    assert torch.equal(draft.lm_head.weight, state["lm_head.weight"])
    trainable = {n for n, p in draft.named_parameters() if p.requires_grad}
    assert trainable == set(layer)  # embedding and lm_head frozen


def test_build_errors_without_mtp_weights_and_for_a_layout_the_config_does_not_describe(tiny_llama_dir, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from tiny_speculators.models import get_family

    family = get_family("mtp")
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    with pytest.raises(UserError, match=r"has no MTP weights .*pass --mtp-init random"):
        family.build(_inputs(tiny_llama_dir, config), family.options())
    fresh = family.build(_inputs(tiny_llama_dir, config), family.options(init="random"))
    assert fresh.kwargs["qkv_bias"] is False and "self_attn.q_proj.bias" not in fresh.state_dict()
    deepseek = tmp_path / "deepseek"
    deepseek.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", deepseek / "config.json")
    save_file({"model.embed_tokens.weight": torch.zeros(config.vocab_size, 64),
               "lm_head.weight": torch.zeros(config.vocab_size, 64),
               "model.layers.8.enorm.weight": torch.ones(64), "model.layers.8.eh_proj.weight": torch.zeros(64, 128)},
              str(deepseek / "model.safetensors"))
    with pytest.raises(UserError, match=r"has deepseek_v3-layout MTP layers, but its config.json describes a mimo"):
        family.build(_inputs(deepseek, config), family.options())


def test_last_layer_id_is_the_pre_norm_state(tiny_mimo_dir):
    from transformers import AutoModelForCausalLM

    from tiny_speculators.evaluate.target import TargetRunner
    from tiny_speculators.verifier.capture import capture_hidden_states
    from tiny_speculators.verifier.modules import find_parts

    model = AutoModelForCausalLM.from_pretrained(tiny_mimo_dir, dtype=torch.float32).eval()
    parts = find_parts(model)
    ids = torch.tensor([5, 17, 300, 42, 9])
    runner = TargetRunner(model, [8])
    logits, aux = runner.forward(ids, torch.arange(5))
    torch.testing.assert_close(parts.lm_head(parts.norm(aux)).float(), logits, atol=1e-5, rtol=0)
    aux2, last = capture_hidden_states(model, ids[None], None, [8])
    torch.testing.assert_close(aux2[0], aux, atol=1e-6, rtol=0)
    assert torch.equal(aux2, last)


def test_export_stitches_the_layer_into_a_copy_of_the_verifier(tiny_mimo_dir, tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from tiny_speculators.export.stage import export
    from tiny_speculators.models import get_family
    from tiny_speculators.models.checkpoint import save_draft
    from tiny_speculators.models.importing import import_draft

    family = get_family("mtp")
    draft = family.build(_inputs(tiny_mimo_dir, AutoConfig.from_pretrained(tiny_mimo_dir)), family.options())
    with torch.no_grad():
        draft.input_proj.weight.add_(0.01)  # "trained"
    save_draft(tmp_path / "ckpt", draft, {"verifier": {"name_or_path": str(tiny_mimo_dir), "architectures": [],
                                                       "hidden_size": 64, "vocab_size": draft.kwargs["vocab_size"]}})
    summary = export(tmp_path / "ckpt", out=tmp_path / "out")
    assert summary["format"] == "verifier-mtp" and summary["vllm_speculative_config"] == {
        "method": "mtp", "num_speculative_tokens": 3}
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["MiMoForCausalLM"] and cfg["num_nextn_predict_layers"] == 1
    assert (tmp_path / "out" / "tokenizer.json").is_file() and (tmp_path / "out" / "generation_config.json").is_file()
    ours, theirs = load_file(str(tmp_path / "out" / "model.safetensors")), load_file(
        str(tiny_mimo_dir / "model.safetensors"))
    assert set(ours) == set(theirs)
    changed = {k for k in ours if not torch.equal(ours[k], theirs[k])}
    assert changed == {"model.mtp_layers.0.input_proj.weight"}
    back, config = import_draft(tmp_path / "out")
    assert config["source"]["format"] == "verifier-mtp"
    for k, v in draft.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    fresh = family.build(_inputs(tiny_llama_dir, AutoConfig.from_pretrained(tiny_llama_dir)),
                         family.options(init="random"))
    save_draft(tmp_path / "llama", fresh, {"verifier": {"name_or_path": str(tiny_llama_dir)}})
    with pytest.raises(UserError, match="serves mimo-layout MTP layers for MiMoForCausalLM verifiers"):
        export(tmp_path / "llama", out=tmp_path / "out2")
