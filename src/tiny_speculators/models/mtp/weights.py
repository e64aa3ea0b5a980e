"""Read a verifier's own MTP weights straight from its safetensors (``transformers`` drops them as unexpected keys).

Layouts:

* **MiMo** (``MiMoForCausalLM``): ``model.mtp_layers.{k}.{token_layernorm, hidden_layernorm, input_proj,
  input_layernorm, self_attn.*, post_attention_layernorm, mlp.*, final_layernorm}``; the embedding and lm_head
  are the verifier's. Supported: read, trained, written back.
* **DeepSeek-V3** (``DeepseekV3ForCausalLM``): ``model.layers.{N+k}.{enorm, hnorm, eh_proj, shared_head.norm,
  shared_head.head, <an MLA + MoE/dense decoder layer>}`` (N = num_hidden_layers; the layer's ``embed_tokens``, when
  stored, is the verifier's). Supported: read, trained, written back (``deepseek.py`` maps the expert names).

    from tiny_speculators.models.mtp.weights import mtp_layout, read_mimo_layer
    print(mtp_layout("path/to/MiMo-7B-RL", num_hidden_layers=36))   # ('mimo', 1)
"""

from __future__ import annotations

from pathlib import Path

import torch

from tiny_speculators.errors import UserError
from tiny_speculators.verifier.describe import read_prefixed, read_tensors, safetensor_index
from tiny_speculators.verifier.load import resolve_verifier

__all__ = ["mtp_layout", "read_mimo_layer", "read_prefixed", "read_shared", "verifier_folder"]

EMBED_KEYS = ("model.embed_tokens.weight", "embed_tokens.weight")


def verifier_folder(name: str) -> Path:
    """The local folder of a verifier (a path or an embedded name); a hub id gets a one-line error."""
    folder = Path(resolve_verifier(name))
    if not folder.is_dir():
        raise UserError(f"verifier {name!r} is not a local folder: MTP weights are read from the verifier's own "
                        "safetensors, so download it first and pass the folder")
    return folder


def mtp_layout(folder: Path, num_hidden_layers: int) -> tuple[str, int] | None:
    """``(layout, number of MTP layers)`` found in the verifier's safetensors, or None when it has none."""
    keys = safetensor_index(folder)
    mimo = {int(k.split(".")[2]) for k in keys if k.startswith("model.mtp_layers.")}
    if mimo:
        return "mimo", max(mimo) + 1
    deepseek = {int(k.split(".")[2]) for k in keys
                if k.startswith("model.layers.") and k.endswith(".eh_proj.weight")}
    if deepseek:
        return "deepseek_v3", len([i for i in deepseek if i >= num_hidden_layers])
    return None


def read_mimo_layer(folder: Path, index: int, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of MTP layer ``index`` (MiMo layout), keyed without ``model.mtp_layers.{index}.``."""
    keys = safetensor_index(folder)
    prefix = f"model.mtp_layers.{index}."
    missing = [n for n in names if prefix + n not in keys]
    if missing:
        raise UserError(f"{folder} lacks MTP tensor(s) {', '.join(prefix + n for n in missing)}")
    state = read_tensors(keys, [prefix + n for n in names])
    return {k.removeprefix(prefix): v for k, v in state.items()}


def read_shared(folder: Path, tie_word_embeddings: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The verifier's ``(embed_tokens [V, H], lm_head [V, H])`` (the lm_head is the embedding when tied)."""
    keys = safetensor_index(folder)
    embed = next((k for k in EMBED_KEYS if k in keys), None)
    if embed is None:
        raise UserError(f"{folder} has no token embedding ({' or '.join(EMBED_KEYS)}) in its safetensors")
    names = [embed] + (["lm_head.weight"] if "lm_head.weight" in keys else [])
    if len(names) == 1 and not tie_word_embeddings:
        raise UserError(f"{folder} has no lm_head.weight and its config does not tie the embeddings")
    state = read_tensors(keys, names)
    return state[embed], state.get("lm_head.weight", state[embed])
