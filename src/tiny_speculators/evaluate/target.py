"""The verifier side of speculative decoding: one Hugging Face model, one KV cache, aux hidden-state hooks.

``TargetRunner.forward(tokens, positions, tree_mask)`` runs the verifier on new tokens on top of its
``DynamicCache`` and returns the logits and the EAGLE-3 auxiliary hidden states (the INPUT of each aux
layer, i.e. ``output_hidden_states[i]``, concatenated in ``aux_layer_ids`` order) of those tokens, captured
with forward pre-hooks during that same pass. ``crop(n)`` rolls the cache back after a rejection;
``keep(indices)`` compacts it after a tree verification so that only the accepted path stays.

    from tiny_speculators.verifier.load import load_verifier
    model, _ = load_verifier("smollm2-135m"); t = TargetRunner(model, [2, 15, 27])
    logits, aux = t.forward(torch.tensor([1, 2, 3]), torch.arange(3))
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.verifier.modules import find_parts

__all__ = ["TargetRunner", "additive_mask"]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [T, S] (True = attend) -> float [1, 1, T, S] additive mask (0 / dtype min), eager and SDPA alike."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


class TargetRunner:
    """A frozen HF causal LM with a reusable KV cache and aux hidden-state capture (batch size 1)."""

    def __init__(self, model: nn.Module, aux_layer_ids: list[int]):
        from transformers import DynamicCache

        self.model = model
        self.parts = find_parts(model)
        bad = [i for i in aux_layer_ids if not 0 <= i <= self.parts.num_hidden_layers]  # N: the last layer's output
        if bad:
            raise UserError(f"aux layer ids {bad} do not exist in a verifier with {self.parts.num_hidden_layers} "
                            "layers")
        self.aux_layer_ids = list(aux_layer_ids)
        self._dynamic_cache = DynamicCache
        self.cache = None
        self.reset()
        self._captured: dict[int, torch.Tensor] = {}
        n = self.parts.num_hidden_layers
        self._hooks = [self.parts.layers[i].register_forward_pre_hook(self._hook(i), with_kwargs=True)
                       for i in self.aux_layer_ids if i < n]
        if n in self.aux_layer_ids:  # id N: the last layer's output, before the final norm
            self._hooks.append(self.parts.layers[-1].register_forward_hook(self._last_hook(n)))
        self.forwards = 0
        # transformers 5.x renamed past_key_values -> cache; accept both
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._logits_to_keep = "logits_to_keep" in params

    def _hook(self, layer_id: int):
        def pre_hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self._captured[layer_id] = hidden.detach()
        return pre_hook

    def _last_hook(self, layer_id: int):
        def hook(module, args, output):
            self._captured[layer_id] = (output[0] if isinstance(output, (tuple, list)) else output).detach()
        return hook

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def reset(self) -> None:
        self.cache = self._dynamic_cache(config=self.model.config)
        self.shift = 0  # RoPE position - cache slot after a prompt with images (M-RoPE's rope delta)
        # sliding-window layers (Gemma 3, gpt-oss, Mistral) keep what a rejection may roll back until the next crop
        activate = getattr(self.cache, "activate_past_recording", None)
        if activate is not None:
            activate()

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @property
    def device(self) -> torch.device:
        return self.parts.embed_tokens.weight.device

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                tree_mask: torch.Tensor | None = None,
                last_logits_only: bool = False,
                images: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``tokens`` [T] at cache slots ``positions`` [T]; returns (logits float32 [T, V], aux [T, n_aux * H]).

        ``tree_mask`` (bool [T, T], True = attend) restricts attention among the new tokens; every new
        token always attends to the whole cached prefix. ``None`` means causal. ``last_logits_only``
        (prefill) returns logits [1, V] for the last token only, skipping the lm_head elsewhere. ``images``
        (a vision-language verifier's prompt, the prefill): its image inputs and ``position_ids`` [3, T] (its
        M-RoPE positions); later slots then run at their slot + the prompt's shift, as the model's own
        ``rope_deltas``.
        """
        device = self.device
        tokens = tokens.to(device)[None]  # (1, T)
        kwargs = {}
        if images is not None:
            rope = images["position_ids"]
            self.shift = int(rope.max()) + 1 - tokens.shape[1]
            positions = rope.to(device)[:, None]  # (3, 1, T)
            kwargs.update({k: v.to(device) for k, v in images.items() if k != "position_ids"})
        else:
            positions = (positions + self.shift).to(device)[None]
        if tree_mask is not None:
            prefix = torch.ones(tree_mask.shape[0], self.length, dtype=torch.bool, device=device)
            allowed = torch.cat([prefix, tree_mask.to(device)], dim=1)  # (T, S)
            kwargs["attention_mask"] = additive_mask(allowed, self.parts.embed_tokens.weight.dtype)
        if last_logits_only and self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        self._captured.clear()
        out = self.model(input_ids=tokens, position_ids=positions, use_cache=True,
                         **{self._cache_kw: self.cache}, **kwargs)
        self.forwards += 1
        aux = torch.cat([self._captured[i][0] for i in self.aux_layer_ids], dim=-1)  # (T, n_aux*H)
        logits = out.logits[0].float()
        return (logits[-1:] if last_logits_only else logits), aux

    @torch.no_grad()
    def rope_positions(self, ids: list[int], images: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[3, T]`` a vision-language verifier's M-RoPE positions of a prompt with images (its own
        ``get_rope_index``)."""
        multimodal = self.parts.multimodal
        if multimodal is None:
            raise UserError(f"{type(self.model).__name__} reads no images")
        rope, _ = multimodal.get_rope_index(torch.tensor([ids], device=self.device),
                                            images["mm_token_type_ids"].to(self.device),
                                            image_grid_thw=images["image_grid_thw"].to(self.device))
        return rope[:, 0].cpu()

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached positions (sliding-window layers: the last window of them)."""
        if "tokens_to_remove" in inspect.signature(self.cache.crop).parameters:  # transformers >= 5.x
            if length <= self.length:  # 0 too: sliding layers drop what the next step no longer needs
                self.cache.crop(length - self.length)
        elif length < self.length:
            self.cache.crop(length)

    def keep(self, indices: torch.Tensor) -> None:
        """Keep only the cached entries at ``indices`` (ascending), in that order, in every layer."""
        indices = indices.to(self.device)
        for layer in self.cache.layers:
            if type(layer).__name__ != "DynamicLayer":
                raise UserError(f"tree decoding needs plain (non-sliding) KV cache layers; this verifier uses "
                                f"{type(layer).__name__}")
            if layer.is_initialized and layer.keys.numel():
                layer.keys = layer.keys.index_select(-2, indices)
                layer.values = layer.values.index_select(-2, indices)
