"""The EAGLE-3 draft model: exactly the computation vLLM runs when it serves the draft.

One decoder layer (or ``num_layers``) on top of the verifier's token embeddings and a fusion of verifier hidden
states (equations as in vLLM's ``llama_eagle3.py``; names as in the speculators format)::

    g      = fc(concat(aux_1, ..., aux_n))                       # fuse(): step 0 only,  (B, T, H)
    e      = input_layernorm(embed_tokens(input_ids))            # (B, T, H)
    hn     = hidden_norm(h);   r = hn if norm_before_residual else h
    a      = o_proj(Attn(q/k/v_proj(concat(e, hn))))            # q/k/v take 2H, RoPE on q/k
    r      = a + r;            x = post_attention_layernorm(r)
    out    = mlp(x) + r                                          # PRE-norm output of layer 0
    # layers 1..L-1 (num_layers > 1): plain Llama/Qwen3 layers on the H stream, the embedding not re-injected
    out    = out + attn_i(input_layernorm_i(out));   out = out + mlp_i(post_attention_layernorm_i(out))
    logits = lm_head(norm(out))                                  # (B, T, draft_vocab)

``h`` is ``fuse(aux)`` at the first draft step and ``out`` of the previous draft step afterwards:
vLLM feeds the pre-norm sum back (its model returns ``(norm(out), out)`` and keeps the second).
Draft id ``i`` is target id ``i + d2t[i]``.

Quick check (tiny CPU draft)::

    python -c "import torch; from tiny_speculators.models.eagle3.model import Eagle3Draft; \
d = Eagle3Draft(vocab_size=100, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, \
intermediate_size=64, draft_vocab_size=50); ids = torch.randint(0, 100, (1, 5)); \
print(d(ids, d.fuse(torch.randn(1, 5, 96)), torch.arange(5)[None]).logits.shape)"
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from tiny_speculators.errors import UserError
from tiny_speculators.models.attention import KVCache
from tiny_speculators.models.layers import (
    DraftOutput,
    FusedInputDraft,
    add_output_layers,
    check_layer_type,
    decoder_stack,
)
from tiny_speculators.models.shape import DraftShape

__all__ = ["KWARGS", "Eagle3Draft", "Eagle3Output"]

Eagle3Output = DraftOutput  # logits (B, T, draft_vocab) or None, hidden_states (B, T, H) pre-norm output

# The draft's kwargs in the order its checkpoints have always written them (``num_layers`` last, only when not 1)
KWARGS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
          "draft_vocab_size", "target_hidden_size", "num_aux", "rms_norm_eps", "rope_parameters",
          "max_position_embeddings", "attention_bias", "layer_type", "norm_before_residual", "norm_before_fc",
          "fc_norm", "norm_output", "train_embeddings", "hidden_act", "aux_layer_ids")


class Eagle3Draft(FusedInputDraft):
    """EAGLE-3 draft (one decoder layer, or ``num_layers``), built from plain keyword arguments.

    Args:
        layer_type: "llama" (default) or "qwen3" (adds per-head ``q_norm``/``k_norm``).
        norm_before_residual: residual is ``hidden_norm(h)`` instead of ``h`` (vLLM flag).
        norm_before_fc: one RMSNorm (``input_norm``) over the whole ``num_aux * Ht`` input of ``fc``.
        fc_norm: one RMSNorm per aux chunk (``fc_norm.{i}``) before ``fc`` (EAGLE 3.1).
        norm_output: the step's output is ``norm(h)``: that post-norm state is fed back to the next step and
            ``lm_head`` reads it as is (speculators' ``norm_output``, its EAGLE-3 default since 0.9).
        num_layers: decoder layers: layer 0 the EAGLE-3 layer, the rest plain layers of ``layer_type`` (as vLLM
            runs a draft whose ``num_hidden_layers`` is above 1).
        sliding_window: every decoder layer attends only to the keys less than this many positions back (as vLLM
            runs a draft layer of ``layer_types`` ``sliding_attention``); None attends to the whole context.
        shape: the :class:`~tiny_speculators.models.shape.DraftShape` fields (vocabulary, attention, MLP, norms,
            RoPE, ``num_aux`` fused verifier states, 3 in EAGLE-3, ``aux_layer_ids``, ``train_embeddings``).
    """

    def __init__(
        self,
        *,
        layer_type: Literal["llama", "qwen3"] = "llama",
        norm_before_residual: bool = False,
        norm_before_fc: bool = False,
        fc_norm: bool = False,
        norm_output: bool = False,
        num_layers: int = 1,
        sliding_window: int | None = None,
        **shape: Any,
    ) -> None:
        super().__init__()
        if num_layers < 1:
            raise UserError(f"num_layers must be at least 1, got {num_layers}")
        if sliding_window is not None and sliding_window < 1:
            raise UserError(f"sliding_window must be at least 1, got {sliding_window}")
        s = DraftShape(**shape)
        check_layer_type(layer_type)
        self.kwargs = s.record(  # exactly what save_draft writes and load_draft rebuilds from
            KWARGS, layer_type=layer_type, norm_before_residual=norm_before_residual, norm_before_fc=norm_before_fc,
            fc_norm=fc_norm, norm_output=norm_output)
        if num_layers != 1:  # one-layer drafts keep the keyword arguments they always had
            self.kwargs["num_layers"] = int(num_layers)
        if sliding_window is not None:  # as do full-attention drafts
            self.kwargs["sliding_window"] = int(sliding_window)
        self.hidden_size, self.draft_vocab_size, self.num_aux = s.hidden_size, s.draft_vocab_size, s.num_aux
        self.target_hidden_size = s.target_hidden_size
        self.norm_output = norm_output

        self.add_input_layers(norm_before_fc=norm_before_fc, fc_norm=fc_norm)  # embed_tokens, input_norm, fc_norm, fc
        self.layers = decoder_stack(self.kwargs, num_layers)
        add_output_layers(self)  # norm, lm_head, rotary, d2t, t2d
        self.reset_parameters()

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """A step's output ``[..., H]`` (pre-norm; post-norm with ``norm_output``) -> logits ``[..., draft_vocab]``."""
        return self.lm_head(hidden_states if self.norm_output else self.norm(hidden_states))

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask=None,
        cache: KVCache | None = None,
        *,
        logits: bool = True,
    ) -> Eagle3Output:
        """One draft step over ``T`` new positions.

        Args:
            input_ids: ``[B, T]`` target-vocab token ids.
            hidden_states: ``[B, T, H]``: ``fuse(aux)`` or the previous step's pre-norm output.
            position_ids: ``[B, T]`` RoPE positions.
            attention_mask: bool ``[B, 1, T, S]`` (True = attend) over all ``S`` keys (cached + new), a
                flex ``BlockMask``, or None for causal attention (after any cached keys).
            cache: a :class:`KVCache`; the new keys/values are appended to it.
            logits: compute ``lm_head(norm(.))``; False returns only the pre-norm output (the TTT loss
                computes logits itself, in chunks).
        """
        embeds = self.embed_tokens(input_ids).to(hidden_states.dtype)  # (B, T, H)
        cos, sin = self.rotary(position_ids, hidden_states.dtype)
        out = self.layers[0](embeds, hidden_states, cos, sin, attention_mask, cache)  # (B, T, H)
        for i, layer in enumerate(self.layers[1:], start=1):
            out = layer(out, cos, sin, attention_mask, None if cache is None else cache.layer(i))
        if self.norm_output:
            out = self.norm(out)  # (B, T, H), fed back as it is
        return Eagle3Output(logits=self.compute_logits(out) if logits else None, hidden_states=out)
