"""Find a verifier's decoder layers, final norm, lm_head and token embedding by inspecting its module tree.

Works for plain causal LMs (``model.model.layers``) and for the wrappers multimodal models use
(``model.language_model.model.layers``, ``model.model.language_model.layers``): the token embedding
and the lm_head are found through the standard ``get_input_embeddings`` / ``get_output_embeddings``
(or by shape), the layer list is the ``nn.ModuleList`` that sits next to the token embedding, and the
final norm is the norm module next to that list. When something cannot be identified the error names
what was found.

    from tiny_speculators.verifier.load import load_verifier
    from tiny_speculators.verifier.modules import find_parts
    parts = find_parts(load_verifier("smollm2-135m")[0]); print(parts.num_hidden_layers, parts.hidden_size)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from tiny_speculators.errors import UserError

__all__ = ["VerifierParts", "find_parts"]


@dataclass
class VerifierParts:
    """The pieces of a decoder-only verifier that extraction and training need.

    ``decoder`` is the module that owns ``layers`` and ``embed_tokens`` (e.g. ``LlamaModel``): calling
    ``decoder(input_ids=..., attention_mask=...)`` runs embeddings -> layers without the lm_head.
    ``decoder_name`` / ``layers_name`` / ... are dotted paths in the model, for messages and logs.
    """

    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Module
    embed_tokens: nn.Embedding
    num_hidden_layers: int
    hidden_size: int
    decoder: nn.Module
    decoder_name: str = ""
    layers_name: str = ""
    norm_name: str = ""
    lm_head_name: str = ""
    multimodal: nn.Module | None = None  # a vision-language model's own model (vision tower + decoder), if any


def _named(model: nn.Module, module: nn.Module) -> str:
    for name, m in model.named_modules():
        if m is module:
            return name
    return "?"


def _is_norm(module: nn.Module, hidden_size: int) -> bool:
    cls = type(module).__name__.lower()
    weight = getattr(module, "weight", None)
    return "norm" in cls and (weight is None or tuple(weight.shape) == (hidden_size,))


def _hf_accessor(model: nn.Module, name: str) -> Any:
    """What ``model.<name>()`` returns (a Hugging Face accessor such as ``get_input_embeddings``); None where the
    model has no such method or its class does not implement it."""
    get = getattr(model, name, None)
    if not callable(get):
        return None
    try:
        return get()
    except (NotImplementedError, AttributeError):
        return None


def _find_embedding(model: nn.Module) -> nn.Embedding:
    emb = _hf_accessor(model, "get_input_embeddings")
    if isinstance(emb, nn.Embedding):
        return emb
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding) and n.endswith("embed_tokens")]
    if len(found) == 1:
        return found[0][1]
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    raise UserError(f"cannot identify the verifier's token embedding ({type(model).__name__}): "
                    f"nn.Embedding modules found: {names or 'none'}")


def _find_lm_head(model: nn.Module, embed: nn.Embedding) -> nn.Module:
    head = _hf_accessor(model, "get_output_embeddings")
    if isinstance(head, nn.Module) and getattr(head, "weight", None) is not None:
        return head
    vocab, hidden = embed.weight.shape
    found = [(n, m) for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and tuple(m.weight.shape) == (vocab, hidden)]
    if len(found) == 1:
        return found[0][1]
    raise UserError(f"cannot identify the verifier's lm_head ({type(model).__name__}): expected one nn.Linear "
                    f"of shape ({vocab}, {hidden}); found {[n for n, _ in found] or 'none'}")


def find_parts(model: nn.Module) -> VerifierParts:
    """Locate the decoder layer list, final norm, lm_head and token embedding of ``model``.

    Raises:
        UserError: naming the candidates found, when a part is missing or ambiguous.
    """
    embed = _find_embedding(model)
    lm_head = _find_lm_head(model, embed)
    hidden_size = embed.embedding_dim
    # The decoder: a module holding the token embedding and a non-empty ModuleList as direct children.
    candidates = []
    for name, module in model.named_modules():
        children = dict(module.named_children())
        if not any(child is embed for child in children.values()):
            continue
        lists = [(n, c) for n, c in children.items() if isinstance(c, nn.ModuleList) and len(c) > 0]
        if lists:
            candidates.append((name, module, lists))
    if len(candidates) != 1 or len(candidates[0][2]) != 1:
        all_lists = [f"{n} ({len(m)})" for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
        owner = _named(model, embed)
        detail = ("several decoder candidates: " + ", ".join(f"{n}.{ln}" for n, _, ls in candidates for ln, _ in ls)
                  if candidates else f"no ModuleList next to the token embedding {owner}")
        raise UserError(f"cannot identify the decoder layers of {type(model).__name__}: {detail}; "
                        f"ModuleLists in the model: {all_lists or 'none'}")
    decoder_name, decoder, [(layers_attr, layers)] = candidates[0]
    # The final norm: a norm module next to the layers; else the only such norm outside any ModuleList.
    norms = [(n, c) for n, c in decoder.named_children() if _is_norm(c, hidden_size)]
    if len(norms) > 1:
        named_norm = [(n, c) for n, c in norms if n in ("norm", "final_layernorm", "ln_f", "final_norm")]
        norms = named_norm if len(named_norm) == 1 else norms
    prefix = f"{decoder_name}." if decoder_name else ""
    if len(norms) == 1:
        norm_name, norm = prefix + norms[0][0], norms[0][1]
    else:
        in_lists = {id(m) for _, ml in model.named_modules() if isinstance(ml, nn.ModuleList) for m in ml.modules()}
        outside = [(n, m) for n, m in model.named_modules() if id(m) not in in_lists and _is_norm(m, hidden_size)
                   and getattr(m, "weight", None) is not None]
        if len(outside) != 1:
            raise UserError(f"cannot identify the final norm of {type(model).__name__}: norm modules of size "
                            f"{hidden_size} outside the layers: {[n for n, _ in outside] or 'none'}")
        norm_name, norm = outside[0]
    # a vision-language wrapper (Qwen-VL: model.model holds .visual and .language_model): what runs images
    outer = model.get_submodule(decoder_name.rpartition(".")[0]) if "." in decoder_name else None
    return VerifierParts(
        layers=layers, norm=norm, lm_head=lm_head, embed_tokens=embed, num_hidden_layers=len(layers),
        hidden_size=hidden_size, decoder=decoder, decoder_name=decoder_name, layers_name=prefix + layers_attr,
        norm_name=norm_name, lm_head_name=_named(model, lm_head),
        multimodal=outer if callable(getattr(outer, "get_image_features", None)) else None,
    )
