"""The P-EAGLE draft (parallel drafting): exactly what vLLM 0.32 runs for ``eagle3`` + ``parallel_drafting``.

EAGLE-3's inputs, ``num_layers`` decoder layers, and one forward that proposes K tokens. Equations (vLLM's
``llama_eagle3.py``; names as in the speculators format)::

    g      = fc(concat(aux_1, ..., aux_n))                 # depth-0 slots: the verifier's fused states, (B, T, H)
    m      = fc(mask_hidden)                               # mask slots (depth >= 1): one learned vector, (H,)
    # layer 0 = the EAGLE-3 layer: reads concat(input_layernorm(embed(id)), hidden_norm(h)), 2H wide
    x      = layer_0(embed(ids), h)                        # pre-norm residual stream, (B, T, H)
    # layers 1..L-1: plain Llama layers on the H stream (the embedding is not re-injected)
    x      = x + attn_i(input_layernorm_i(x));   x = x + mlp_i(post_attention_layernorm_i(x))
    logits = lm_head(norm(x))                              # (B, T, draft_vocab)

Slots (one request, last verified position P, bonus token b): depth-0 slots at positions p <= P hold
(token p+1, verifier state at p) — at P that is (b, state at P) — and mask slots at P+1 .. P+K-1 hold
(``mask_token_id``, m). Attention is causal over the draft's own cache. The output at P proposes the token
after b; mask slot P+k proposes token k+1. Draft id ``i`` is target id ``i + d2t[i]``.

Quick check (tiny CPU draft)::

    python -c "import torch; from tiny_speculators.models.peagle.model import PEagleDraft; \
d = PEagleDraft(vocab_size=100, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, \
intermediate_size=64, draft_vocab_size=50, num_layers=2, mask_token_id=0); ids = torch.randint(0, 100, (1, 5)); \
print(d(ids, d.fuse(torch.randn(1, 5, 96)), torch.arange(5)[None]).logits.shape)"
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.models.attention import KVCache
from tiny_speculators.models.layers import (
    DraftOutput,
    FusedInputDraft,
    add_output_layers,
    check_layer_type,
    check_mask_token,
    decoder_stack,
)
from tiny_speculators.models.shape import DraftShape

__all__ = ["KWARGS", "PEagleDraft"]

# The draft's kwargs in the order its checkpoints have always written them
KWARGS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
          "draft_vocab_size", "num_layers", "mask_token_id", "num_depths", "target_hidden_size", "num_aux",
          "rms_norm_eps", "rope_parameters", "max_position_embeddings", "attention_bias", "layer_type",
          "norm_before_residual", "norm_before_fc", "train_embeddings", "hidden_act", "aux_layer_ids")


class PEagleDraft(FusedInputDraft):
    """P-EAGLE draft: EAGLE-3's fused inputs, ``num_layers`` decoder layers, a learned mask hidden state.

    Args:
        layer_type, norm_before_residual, norm_before_fc: as in EAGLE-3's draft (``models/eagle3/model.py``).
        num_layers: decoder layers (layer 0 is the EAGLE-3 layer, the rest plain Llama/Qwen3 layers).
        mask_token_id: the token id fed at the parallel (mask) slots; its embedding is the verifier's.
        num_depths: positions trained per anchor (depth 0 = the bonus slot); the default speculative tokens.
        shape: the :class:`~tiny_speculators.models.shape.DraftShape` fields.
    """

    def __init__(
        self,
        *,
        num_layers: int = 2,
        mask_token_id: int = 0,
        num_depths: int = 4,
        layer_type: Literal["llama", "qwen3"] = "llama",
        norm_before_residual: bool = False,
        norm_before_fc: bool = False,
        **shape: Any,
    ) -> None:
        super().__init__()
        s = DraftShape(**shape)
        check_layer_type(layer_type)
        if num_layers < 1 or num_depths < 1:
            raise UserError(f"num_layers and num_depths must be at least 1 (got {num_layers}, {num_depths})")
        check_mask_token(mask_token_id, s.vocab_size)
        self.kwargs = s.record(  # exactly what save_draft writes and load_draft rebuilds from
            KWARGS, num_layers=num_layers, mask_token_id=mask_token_id, num_depths=num_depths, layer_type=layer_type,
            norm_before_residual=norm_before_residual, norm_before_fc=norm_before_fc)
        self.hidden_size, self.draft_vocab_size, self.num_aux = s.hidden_size, s.draft_vocab_size, s.num_aux
        self.target_hidden_size, self.mask_token_id = s.target_hidden_size, mask_token_id

        self.add_input_layers(norm_before_fc=norm_before_fc)  # embed_tokens, input_norm, fc (P-EAGLE: no fc_norm)
        self.mask_hidden = nn.Parameter(torch.zeros(1, 1, s.num_aux * s.target_hidden_size))  # pre-fc, like aux states
        self.layers = decoder_stack(self.kwargs, num_layers)
        add_output_layers(self)  # norm, lm_head, rotary, d2t, t2d
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Normal(0, std) for linear/embedding weights, zero biases, unit norms; N(0, 1) for the mask hidden state."""
        super().reset_parameters(std)
        self.mask_hidden.normal_(0.0, 1.0)  # the scale of verifier states, which fc was made for

    def mask_state(self) -> torch.Tensor:
        """The hidden state of every mask slot, ``fc(input_norm?(mask_hidden))``: ``[H]``."""
        return self.fuse(self.mask_hidden.reshape(-1))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Pre-norm output ``[..., H]`` -> draft-vocab logits ``[..., draft_vocab]``."""
        return self.lm_head(self.norm(hidden_states))

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask=None,
        caches: list[KVCache] | None = None,
        *,
        logits: bool = True,
    ) -> DraftOutput:
        """One forward over ``T`` new slots (depth-0 and/or mask slots).

        Args:
            input_ids: ``[B, T]`` target-vocab ids (``mask_token_id`` at mask slots).
            hidden_states: ``[B, T, H]``: ``fuse(aux)`` at depth-0 slots, :meth:`mask_state` at mask slots.
            position_ids: ``[B, T]`` RoPE positions.
            attention_mask: bool ``[B, 1, T, S]`` (True = attend) over all ``S`` keys (cached + new), a
                ``PackedTTTMask`` (depth 0 of packed documents), or None for causal attention.
            caches: one :class:`KVCache` per layer; new keys/values are appended.
            logits: compute ``lm_head(norm(.))``; False returns only the pre-norm output.
        """
        embeds = self.embed_tokens(input_ids).to(hidden_states.dtype)  # (B, T, H)
        cos, sin = self.rotary(position_ids, hidden_states.dtype)
        caches = caches if caches is not None else [None] * len(self.layers)
        x = self.layers[0](embeds, hidden_states, cos, sin, attention_mask, caches[0])  # (B, T, H)
        for layer, cache in zip(self.layers[1:], caches[1:], strict=True):
            x = layer(x, cos, sin, attention_mask, cache)
        return DraftOutput(logits=self.compute_logits(x) if logits else None, hidden_states=x)
