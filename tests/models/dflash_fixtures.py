"""Tiny DFlash drafts and what their tests check them against: a float64 reference of vLLM's DFlash forward, a random
batch, and the checkpoint layout speculators writes. Shared by the DFlash and DSpark tests (DSpark is DFlash's
backbone plus heads).

    from dflash_fixtures import reference_hidden, tiny_dflash
"""

from __future__ import annotations

import json
import math

import torch
from draft_fixtures import VOCAB, fixed_init, ref_rms, ref_rope, tiny_kwargs
from safetensors.torch import save_file

from tiny_speculators.models.dflash.model import DFlashDraft

__all__ = ["AUX", "MASK", "WIDTH", "dflash_batch", "reference_forward", "reference_hidden",
           "speculators_dflash_checkpoint", "tiny_dflash"]

MASK, AUX = 3, 5  # mask token id; verifier layers fused (tiny H = 16, so aux states are 80 wide)
WIDTH = AUX * 16


def tiny_dflash(num_layers: int = 2, block_size: int = 4, causal: bool = False, **kw) -> DFlashDraft:
    return fixed_init(DFlashDraft(**tiny_kwargs(num_aux=AUX, **kw), num_layers=num_layers, block_size=block_size,
                                  mask_token_id=MASK, causal=causal))


def reference_forward(draft: DFlashDraft, aux, ctx_pos, block_ids, block_pos):
    """:func:`reference_hidden` through the draft's ``lm_head``: logits ``(n, Vd)``, float64."""
    return reference_hidden(draft, aux, ctx_pos, block_ids, block_pos) @ draft.state_dict()["lm_head.weight"].double().T


def reference_hidden(draft: DFlashDraft, aux, ctx_pos, block_ids, block_pos):
    """vLLM 0.32's DFlash forward for one request, float64, plain loops (qwen3_dflash.py):
    ``precompute_and_store_context_kv`` writes k_norm(k_proj(hidden_norm(fc(aux)))) + RoPE and v_proj(...) at the
    context positions into every layer's cache; the query block [bonus, mask...] runs Qwen3 layers whose
    attention sees the whole context and the whole block (or the block up to itself when causal). Returns the
    final norm's output ``(n, H)``."""
    sd = {k: v.double() for k, v in draft.state_dict().items()}
    kw = draft.kwargs
    nh, nkv, hd = kw["num_attention_heads"], kw["num_key_value_heads"], kw["head_dim"]
    t, n = aux.shape[0], block_ids.shape[0]
    c = ref_rms(aux.double() @ sd["fc.weight"].T, sd["hidden_norm.weight"])  # (T, H)
    x = sd["embed_tokens.weight"][block_ids]  # (n, H)
    for i in range(kw["num_layers"]):
        p = f"layers.{i}."

        def proj(name, v, heads, p=p):
            return (v @ sd[f"{p}self_attn.{name}.weight"].T).view(v.shape[0], heads, hd)

        k_ctx = ref_rope(ref_rms(proj("k_proj", c, nkv), sd[f"{p}self_attn.k_norm.weight"]), ctx_pos)
        v_ctx = proj("v_proj", c, nkv)
        xn = ref_rms(x, sd[f"{p}input_layernorm.weight"])
        q = ref_rope(ref_rms(proj("q_proj", xn, nh), sd[f"{p}self_attn.q_norm.weight"]), block_pos)
        k_blk = ref_rope(ref_rms(proj("k_proj", xn, nkv), sd[f"{p}self_attn.k_norm.weight"]), block_pos)
        v_blk = proj("v_proj", xn, nkv)
        out = torch.zeros(n, nh, hd, dtype=torch.float64)
        for head in range(nh):
            g = head // (nh // nkv)
            for s in range(n):
                seen = range(s + 1) if kw["causal"] else range(n)
                keys = [k_ctx[j, g] for j in range(t)] + [k_blk[j, g] for j in seen]
                vals = [v_ctx[j, g] for j in range(t)] + [v_blk[j, g] for j in seen]
                scores = torch.stack([q[s, head] @ key for key in keys]) / math.sqrt(hd)
                out[s, head] = torch.softmax(scores, 0) @ torch.stack(vals)
        x = x + out.reshape(n, nh * hd) @ sd[f"{p}self_attn.o_proj.weight"].T
        h = ref_rms(x, sd[f"{p}post_attention_layernorm.weight"])
        gate, up = h @ sd[f"{p}mlp.gate_proj.weight"].T, h @ sd[f"{p}mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ sd[f"{p}mlp.down_proj.weight"].T
    return ref_rms(x, sd["norm.weight"])  # (n, H): the final-norm output the heads read


def dflash_batch(b=2, t=16, seed=0, packed=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    aux = torch.randn(b, t, WIDTH, generator=g)
    mask = torch.ones(b, t)
    mask[:, :3] = 0
    doc = None
    if packed:
        doc = torch.zeros(b, t, dtype=torch.long)
        doc[:, 7:] = 1
        mask[:, 7:9] = 0
    return ids, aux, mask, doc


def speculators_dflash_checkpoint(folder, verifier_dir, **top):
    """The layout speculators writes for a full-vocabulary DFlash draft: no embed_tokens, no lm_head (both the
    verifier's), Qwen3 layers with q/k norms, ``fc`` over the aux layers and ``hidden_norm``."""
    vc = json.loads((verifier_dir / "config.json").read_text())
    h, v, heads, kv, hd, inter = (vc[k] for k in ("hidden_size", "vocab_size", "num_attention_heads",
                                                  "num_key_value_heads", "head_dim", "intermediate_size"))
    g = torch.Generator().manual_seed(0)
    w = {"fc.weight": torch.randn(h, 3 * h, generator=g) * 0.03, "hidden_norm.weight": torch.rand(h, generator=g) + .5,
         "norm.weight": torch.ones(h)}
    for i in range(2):
        p = f"layers.{i}."
        for name, shape in (("self_attn.q_proj", (heads * hd, h)), ("self_attn.k_proj", (kv * hd, h)),
                            ("self_attn.v_proj", (kv * hd, h)), ("self_attn.o_proj", (h, heads * hd)),
                            ("mlp.gate_proj", (inter, h)), ("mlp.up_proj", (inter, h)), ("mlp.down_proj", (h, inter))):
            w[f"{p}{name}.weight"] = torch.randn(*shape, generator=g) * 0.05
        for name in ("input_layernorm", "post_attention_layernorm"):
            w[f"{p}{name}.weight"] = torch.ones(h)
        for name in ("q_norm", "k_norm"):
            w[f"{p}self_attn.{name}.weight"] = torch.rand(hd, generator=g) + 0.5
    save_file(w, str(folder / "model.safetensors"))
    layer = {k: vc[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings")}
    cfg = {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash", "draft_vocab_size": v,
           "block_size": 8, "aux_hidden_state_layer_ids": [2, 4, 5], "mask_token_id": 7,
           "sliding_window_non_causal": False, "sample_from_anchor": False,
           "transformer_layer_config": {**layer, "model_type": "qwen3", "num_hidden_layers": 2,
                                        "layer_types": ["full_attention", "full_attention"]},
           "speculators_config": {"algorithm": "dflash", "proposal_methods": [{"speculative_tokens": 7}],
                                  "verifier": {"name_or_path": str(verifier_dir)}}, **top}
    (folder / "config.json").write_text(json.dumps(cfg))
    return w
