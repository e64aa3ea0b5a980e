"""One multi-token-prediction (MTP) layer of a verifier: exactly what vLLM 0.32 runs for MiMo's ``mimo_mtp`` and
for DeepSeek-V3's ``deepseek_mtp`` (``layout``).

Equations (vLLM's ``mimo_mtp.py``; names as in MiMo's checkpoint ``model.mtp_layers.{k}.*``)::

    e      = embed_tokens(x_{t+1}), zeroed where position == 0           # (B, T, H); the verifier's embedding
    u      = input_proj(concat(hidden_layernorm(h_t), token_layernorm(e)))  # hidden FIRST, then token; (B, T, H)
    r      = u + self_attn(input_layernorm(u))                           # one Qwen2/Llama decoder layer
    out    = r + mlp(post_attention_layernorm(r))
    y      = final_layernorm(out)                                        # what the model returns, (B, T, H)
    logits = lm_head(y)                                                  # the verifier's lm_head, predicts x_{t+2}

DeepSeek-V3 (``deepseek_mtp.py``; names ``model.layers.{N+k}.*``): the same shape with the TOKEN FIRST::

    u      = eh_proj(concat(enorm(e), hnorm(h_t)))                      # embedding first, then hidden
    out    = <DeepSeek-V3 decoder block: MLA attention, MoE or dense MLP>(u)    (``deepseek.py``)
    y      = shared_head.norm(out)          # vLLM: logits = head(shared_head.norm(out)), and feeds back the same
    logits = shared_head.head(y)            # the layer's own head (``lm_head`` here; frozen)

``h_t`` is the verifier's last decoder layer output BEFORE its final norm at the first draft step (vLLM's
MiMo target model returns ``hidden_states + residual``), and the layer's own output ``y`` (after
``final_layernorm``: vLLM feeds back what the MTP model returns) at every further chained step. The embedding
and lm_head are the verifier's and stay frozen; the draft vocabulary is the verifier's whole vocabulary
(``d2t`` zeros, ``t2d`` all true, kept so the shared training loss treats every family alike).

Quick check (tiny CPU layer)::

    python -c "import torch; from tiny_speculators.models.mtp.model import MTPDraft; \
d = MTPDraft(vocab_size=100, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, \
intermediate_size=64, num_hidden_layers=4); ids = torch.randint(0, 100, (1, 5)); \
print(d(ids, d.fuse(torch.randn(1, 5, 32)), torch.arange(5)[None]).logits.shape)"
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.models.attention import KVCache
from tiny_speculators.models.layers import (
    MLP,
    Attention,
    DraftOutput,
    RMSNorm,
    init_weights,
    rotary_of,
)
from tiny_speculators.models.mtp import deepseek
from tiny_speculators.models.shape import LAYER_SHAPE, DraftShape

__all__ = ["KWARGS", "LAYER_TENSORS", "MTPDraft"]

# The draft's kwargs in the order its checkpoints have always written them
KWARGS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
          "num_hidden_layers", "rms_norm_eps", "rope_parameters", "max_position_embeddings", "qkv_bias", "mtp_index",
          "aux_layer_ids", "layout", "deepseek")

# The MTP layer's own tensors, named as in MiMo's checkpoint after ``model.mtp_layers.{k}.`` (bias: qkv_bias only)
LAYER_TENSORS = (
    "token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight",
    "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "post_attention_layernorm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "final_layernorm.weight",
)
BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
SHARED = ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d")  # the verifier's, or vocabulary maps
LAYOUTS = ("mimo", "deepseek_v3")


class MTPDraft(nn.Module):
    """A verifier's MTP layer (MiMo layout) with the verifier's frozen embedding and lm_head.

    Args:
        num_hidden_layers: the verifier's decoder layers N; the draft reads the output of layer N-1 (before the
            final norm), recorded as ``aux_layer_ids = [N]``.
        qkv_bias: biases on q/k/v (Qwen2 and MiMo: true); o_proj never has one.
        mtp_index: which of the verifier's MTP layers this is (``model.mtp_layers.{mtp_index}``).
        aux_layer_ids: must be ``[num_hidden_layers]`` (accepted so checkpoints rebuild from their kwargs).
        layout: ``mimo`` (``model.mtp_layers.{k}``) or ``deepseek_v3`` (``model.layers.{N+k}``).
        deepseek: the verifier's DeepSeek-V3 fields (``deepseek.FIELDS``), for ``layout: deepseek_v3``.
        shape: the decoder-layer fields of :class:`~tiny_speculators.models.shape.DraftShape` (``LAYER_SHAPE``:
            vocabulary, attention, MLP, norm eps, RoPE), the verifier's (the layer is one of its own).
    """

    def __init__(
        self,
        *,
        num_hidden_layers: int,
        qkv_bias: bool = True,
        mtp_index: int = 0,
        aux_layer_ids: list[int] | None = None,
        layout: str = "mimo",
        deepseek: dict[str, Any] | None = None,
        **shape: Any,
    ) -> None:
        super().__init__()
        if aux_layer_ids is not None and [int(i) for i in aux_layer_ids] != [num_hidden_layers]:
            raise UserError(f"an MTP layer reads the verifier's last hidden state (aux layer id {num_hidden_layers}), "
                            f"not aux layers {list(aux_layer_ids)}")
        unknown = sorted(set(shape) - set(LAYER_SHAPE))
        if unknown:  # what DraftShape has beyond a layer's shape: a fused draft's, not this one's
            raise TypeError(f"MTPDraft.__init__() got unexpected keyword arguments {unknown}")
        s = DraftShape(**shape, num_aux=1)
        self.kwargs = s.record(  # exactly what save_draft writes and load_draft rebuilds from
            KWARGS, num_hidden_layers=num_hidden_layers, qkv_bias=qkv_bias, mtp_index=mtp_index,
            aux_layer_ids=[int(num_hidden_layers)], layout=layout, deepseek=deepseek)
        vocab_size, hidden_size, rms_norm_eps = s.vocab_size, s.hidden_size, s.rms_norm_eps
        num_attention_heads, num_key_value_heads, head_dim = s.num_attention_heads, s.num_key_value_heads, s.head_dim
        intermediate_size = s.intermediate_size
        if layout not in LAYOUTS:
            raise UserError(f"MTP layout {layout!r} is not supported (supported: {', '.join(LAYOUTS)})")
        self.layout = layout
        self.hidden_size = hidden_size
        self.draft_vocab_size = vocab_size  # the verifier's lm_head: the whole vocabulary

        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(vocab_size, dtype=torch.bool))
        if layout == "deepseek_v3":
            self._init_deepseek(deepseek)
            return
        self.token_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.hidden_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.input_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.input_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.self_attn = Attention(hidden_size, num_attention_heads, num_key_value_heads, head_dim, False, False,
                                   rms_norm_eps, input_size=hidden_size)
        if qkv_bias:  # Qwen2: biases on q/k/v, none on o_proj (Attention's one flag would put one there too)
            self.self_attn.q_proj = nn.Linear(hidden_size, num_attention_heads * head_dim, bias=True)
            self.self_attn.k_proj = nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=True)
            self.self_attn.v_proj = nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=True)
        self.post_attention_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.mlp = MLP(hidden_size, intermediate_size)
        self.final_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.rotary = rotary_of(self.kwargs)
        self.reset_parameters()
        self.freeze_shared()

    def _init_deepseek(self, fields: dict[str, Any] | None) -> None:
        kw = self.kwargs
        if fields is None:
            raise UserError("an MTP layer in the DeepSeek-V3 layout needs the verifier's DeepSeek-V3 fields")
        hidden, eps = kw["hidden_size"], kw["rms_norm_eps"]
        self._hf_config = deepseek.hf_config(
            fields, vocab_size=kw["vocab_size"], hidden_size=hidden, intermediate_size=kw["intermediate_size"],
            num_attention_heads=kw["num_attention_heads"], rms_norm_eps=eps, rope_parameters=kw["rope_parameters"],
            max_position_embeddings=kw["max_position_embeddings"])
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        layer_idx = kw["num_hidden_layers"] + kw["mtp_index"]
        for name, module in deepseek.block_modules(self._hf_config, deepseek.is_moe(fields, layer_idx)).items():
            self.add_module(name, module)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, eps)
        self.rotary = deepseek.rotary(self._hf_config)
        self.reset_parameters()
        self.freeze_shared()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """A fresh layer (``init: random``): Normal(0, std) weights, zero biases, unit norms."""
        if self.layout == "deepseek_v3":
            deepseek.reset_named(self, std)
            return
        init_weights(self, std)

    def freeze_shared(self) -> None:
        """The embedding and lm_head are the verifier's: never trained."""
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)

    def after_load(self, device: str | torch.device) -> None:
        """After weights were assigned into a meta-device build: rebuild RoPE buffers, re-freeze shared weights."""
        if self.layout == "deepseek_v3":
            self.rotary = deepseek.rotary(self._hf_config).to(device)
            self.freeze_shared()
            return
        self.rotary = rotary_of(self.kwargs).to(device)
        self.freeze_shared()

    def layer_state(self) -> dict[str, torch.Tensor]:
        """The MTP layer's own tensors, named as in the checkpoint after its layer prefix (MiMo:
        ``model.mtp_layers.{k}.``, DeepSeek-V3: ``model.layers.{N+k}.``), without the shared embedding/head."""
        state = self.state_dict()
        if self.layout == "deepseek_v3":
            return deepseek.to_checkpoint({k: v for k, v in state.items() if k not in SHARED})
        names = LAYER_TENSORS + (BIASES if self.kwargs["qkv_bias"] else ())
        return {name: state[name] for name in names}

    def fuse(self, hidden: torch.Tensor) -> torch.Tensor:
        """The verifier's last pre-norm hidden state ``[..., H]`` as the first step's ``h`` (no fusion)."""
        return hidden.to(self.lm_head.weight.dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The layer's (already final-normed) output ``[..., H]`` -> logits over the vocabulary ``[..., V]``."""
        return self.lm_head(hidden_states)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask=None,
        cache: KVCache | None = None,
        *,
        logits: bool = True,
    ) -> DraftOutput:
        """One MTP step over ``T`` new positions.

        Args:
            input_ids: ``[B, T]`` the token after each position (``x_{t+1}``).
            hidden_states: ``[B, T, H]``: the verifier's last pre-norm state, or the previous step's output.
            position_ids: ``[B, T]`` RoPE positions; the token embedding is zeroed where it is 0.
            attention_mask: a mask over all keys, cached + new (the TTT masks of ``models/attention.py``); None: causal.
            cache: a :class:`~tiny_speculators.models.attention.KVCache` the new keys/values are appended to.
            logits: compute ``lm_head(y)``; False returns only ``y`` (the loss computes logits in chunks).

        Returns ``hidden_states = y`` (after ``final_layernorm``; fed back at the next chained step).
        """
        embeds = self.embed_tokens(input_ids).to(hidden_states.dtype)  # (B, T, H)
        embeds = torch.where(position_ids[..., None] == 0, torch.zeros_like(embeds), embeds)
        if self.layout == "deepseek_v3":  # token FIRST in the concat; shared_head.norm is the final norm
            u = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden_states)], dim=-1))  # (B, T, H)
            y = self.shared_head.norm(deepseek.block_forward(self, u, position_ids, attention_mask, cache))
            return DraftOutput(logits=self.compute_logits(y) if logits else None, hidden_states=y)
        cos, sin = self.rotary(position_ids, hidden_states.dtype)
        u = self.input_proj(torch.cat([self.hidden_layernorm(hidden_states), self.token_layernorm(embeds)], dim=-1))
        r = u + self.self_attn(self.input_layernorm(u), cos, sin, attention_mask, cache)  # (B, T, H)
        y = self.final_layernorm(r + self.mlp(self.post_attention_layernorm(r)))  # (B, T, H)
        return DraftOutput(logits=self.compute_logits(y) if logits else None, hidden_states=y)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids are target ids (the whole vocabulary)."""
        return draft_ids
