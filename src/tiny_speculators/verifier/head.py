"""The verifier pieces the trainer needs in offline mode: final norm + lm_head (the target head) and the
token embedding, loaded WITHOUT the decoder layers.

The verifier is instantiated on the ``meta`` device from its config (no memory), :func:`find_parts`
names its norm / lm_head / embedding, and only those tensors are read from the safetensors files
(through ``model.safetensors.index.json`` when sharded). For an 8B verifier that is ~1.1 GB instead
of 16 GB. If the folder has no safetensors (a hub id, a .bin checkpoint) or a name does not match,
the full verifier is loaded instead (slower, same result).

    head = load_verifier_head("smollm2-135m")
    logits = head.target_head(last_hidden_state)   # (N, V) == verifier logits
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tiny_speculators.verifier.describe import read_tensors, safetensor_index
from tiny_speculators.verifier.load import load_verifier, model_class, resolve_verifier
from tiny_speculators.verifier.modules import find_parts

log = logging.getLogger(__name__)


class TargetHead(nn.Module):
    """``last_hidden_state [..., Ht]`` (pre-norm) -> verifier logits ``[..., V]``; frozen."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.requires_grad_(False)

    def forward(self, last_hidden_state: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(last_hidden_state))


@dataclass
class VerifierHead:
    config: object  # the verifier's transformers config
    target_head: TargetHead
    embed_weight: torch.Tensor  # (V, Ht)
    partial: bool  # True when only these tensors were read


def _param_names(model: nn.Module, module: nn.Module) -> dict[str, list[str]]:
    """Local parameter name of ``module`` -> every full name (tied weights have several) in ``model``."""
    ids = {id(p): local for local, p in module.named_parameters()}
    names: dict[str, list[str]] = {}
    for full, p in model.named_parameters(remove_duplicate=False):
        if id(p) in ids:
            names.setdefault(ids[id(p)], []).append(full)
    return names


def _load_partial(folder: Path, config, dtype: torch.dtype) -> VerifierHead | None:
    from transformers import AutoModelForCausalLM

    files = safetensor_index(folder)
    if not files:
        return None
    with torch.device("meta"):
        model = model_class(config, AutoModelForCausalLM).from_config(config, dtype=dtype)
    parts = find_parts(model)
    loaded = {}
    for key, module in (("norm", parts.norm), ("lm_head", parts.lm_head), ("embed", parts.embed_tokens)):
        tensors = {}
        for local, fulls in _param_names(model, module).items():
            hit = next((n for n in fulls if n in files), None)
            if hit is None:
                log.info("verifier tensor for %s (%s) not found by name; loading the full verifier", key, fulls)
                return None
            tensors[local] = read_tensors(files, [hit])[hit].to(dtype)
        module.to_empty(device="cpu")
        module.load_state_dict(tensors, strict=False)
        for name, buf in module.named_buffers():  # non-persistent buffers (rare in norms): recompute is not possible
            if buf.is_meta:
                log.info("verifier %s has a meta buffer %s; loading the full verifier", key, name)
                return None
        loaded[key] = module
    return VerifierHead(config=config, target_head=TargetHead(loaded["norm"], loaded["lm_head"]),
                        embed_weight=loaded["embed"].weight.detach(), partial=True)


def head_from_model(model: nn.Module) -> VerifierHead:
    """The same pieces from an already loaded verifier (online training)."""
    parts = find_parts(model)
    return VerifierHead(config=model.config, target_head=TargetHead(parts.norm, parts.lm_head),
                        embed_weight=parts.embed_tokens.weight.detach(), partial=False)


def load_verifier_head(name: str, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False) -> VerifierHead:
    """Norm + lm_head + embedding of verifier ``name`` (see the module docstring)."""
    from transformers import AutoConfig

    source = resolve_verifier(name)
    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    folder = Path(source)
    if folder.is_dir():
        head = _load_partial(folder, config, dtype)
        if head is not None:
            log.info("loaded the verifier's norm, lm_head and embedding only (%s)", source)
            return head

    model, _ = load_verifier(name, dtype=dtype, trust_remote_code=trust_remote_code, with_tokenizer=False)
    return head_from_model(model)
