"""The ``verifier-mtp`` format: the fine-tuned MTP layer stitched back into a copy of the verifier's checkpoint,
which is what ``vllm serve <folder> --speculative-config '{"method": "mtp", "num_speculative_tokens": N}'`` loads.

* ``config.json``: the verifier's, with ``num_nextn_predict_layers`` covering the layer (vLLM resolves a
  ``MiMoForCausalLM`` verifier's draft to ``MiMoMTPModel``, a ``DeepseekV3ForCausalLM``'s to ``DeepSeekMTPModel``).
* ``model.safetensors``: every tensor of the verifier, with the trained layer's own tensors written over the same
  names (MiMo: ``model.mtp_layers.{k}.*``; DeepSeek-V3: ``model.layers.{N+k}.*``, the routed experts split back
  per expert); the embedding and ``shared_head.head`` (frozen) stay the verifier's bytes.
* the verifier's other files (tokenizer, generation config) are copied beside them (``companions``).

Reading goes the other way, so any such verifier folder with MTP weights is also an MTP draft:
``evaluate --draft <verifier>`` measures its original MTP layer and ``train --init-from <verifier>`` starts from it.

    tiny-speculators export runs/mtp-train --out runs/mimo-mtp      # then vllm serve runs/mimo-mtp ...
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tiny_speculators.errors import UserError
from tiny_speculators.models.family import DraftFormat, ExportInfo
from tiny_speculators.models.files import cast_state, read_json, read_weights, require
from tiny_speculators.models.mtp import deepseek
from tiny_speculators.models.mtp.model import BIASES, LAYER_TENSORS, SHARED, MTPDraft
from tiny_speculators.models.mtp.weights import mtp_layout, verifier_folder
from tiny_speculators.models.shape import rope_parameters_of
from tiny_speculators.verifier.describe import config_value

ARCHITECTURES = {"mimo": "MiMoForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}  # layout -> verifier class
SKIP = ("model.safetensors.index.json", "config.json", "README.md", "summary.json")

__all__ = ["FORMAT", "draft_kwargs", "layer_from_tensors", "layer_prefix"]


def layer_prefix(kwargs: Mapping[str, Any]) -> str:
    """Where MTP layer ``mtp_index`` lives in the verifier's checkpoint."""
    if kwargs.get("layout", "mimo") == "deepseek_v3":
        return f"model.layers.{int(kwargs['num_hidden_layers']) + int(kwargs['mtp_index'])}."
    return f"model.mtp_layers.{int(kwargs['mtp_index'])}."


def layer_from_tensors(kwargs: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], where: str
                       ) -> dict[str, torch.Tensor]:
    """The layer's tensors under the draft's names from the checkpoint's (``tensors`` keyed after
    :func:`layer_prefix`); DeepSeek-V3's ``shared_head.head`` comes back as ``lm_head.weight``."""
    if kwargs.get("layout", "mimo") != "deepseek_v3":
        names = LAYER_TENSORS + (BIASES if kwargs["qkv_bias"] else ())
        missing = [n for n in names if n not in tensors]
        if missing:
            raise UserError(f"{where} lacks MTP tensor(s) {', '.join(missing)}")
        return {n: tensors[n] for n in names}
    with torch.device("meta"):  # only the names (a real DeepSeek-V3 layer is billions of parameters)
        names = [k for k in MTPDraft(**kwargs).state_dict() if k not in SHARED]
    state = deepseek.from_checkpoint(tensors, names, where)
    if "shared_head.head.weight" in tensors:
        state["lm_head.weight"] = tensors["shared_head.head.weight"]
    return state


def draft_kwargs(cfg: Mapping[str, Any], where: str, mtp_index: int = 0) -> dict[str, Any]:
    """``MTPDraft`` kwargs from a MiMo-style verifier config (a mapping or an HF config object)."""
    get = functools.partial(config_value, cfg)
    fields = ["vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers"]
    missing = [k for k in fields if get(k) is None]
    if missing:
        raise UserError(f"{where} is missing required field(s) {', '.join(missing)}")
    hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    qwen2 = str(get("model_type", "")) in ("qwen2", "mimo")
    layout = "deepseek_v3" if get("kv_lora_rank") is not None else "mimo"  # MLA: the DeepSeek-V3 layer
    extra: dict[str, Any] = {}
    if layout == "deepseek_v3":
        extra = dict(layout=layout, deepseek=deepseek.config_fields(get, where))
        qwen2 = False
    return dict(
        vocab_size=int(get("vocab_size")), hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=int(get("num_key_value_heads") or heads), head_dim=int(get("head_dim") or hidden // heads),
        intermediate_size=int(get("intermediate_size")), num_hidden_layers=int(get("num_hidden_layers")),
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)), rope_parameters=rope_parameters_of(cfg),
        max_position_embeddings=int(get("max_position_embeddings", 4096)),
        qkv_bias=(qwen2 or bool(get("attention_bias", False))) and layout == "mimo", mtp_index=mtp_index, **extra,
    )


def write(draft, info: ExportInfo) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    if info.speculative_tokens < 1:
        raise UserError(f"speculative_tokens must be at least 1, got {info.speculative_tokens}")
    folder = verifier_folder(info.verifier_name)
    cfg = read_json(folder / "config.json")
    kwargs, index = draft.kwargs, int(draft.kwargs["mtp_index"])
    layout = kwargs.get("layout", "mimo")
    if ARCHITECTURES[layout] not in (cfg.get("architectures") or []):
        raise UserError(f"{folder}/config.json: vLLM serves {layout}-layout MTP layers for {ARCHITECTURES[layout]} "
                        f"verifiers (architectures {cfg.get('architectures')})")
    found = mtp_layout(folder, int(kwargs["num_hidden_layers"]))
    if found is not None and found[0] != layout:
        raise UserError(f"{folder} holds {found[0]}-layout MTP layers; this draft is a {layout}-layout layer")
    state = read_weights(folder)
    shared = draft.state_dict()
    prefix = layer_prefix(kwargs)
    head = prefix + "shared_head.head.weight" if layout == "deepseek_v3" else "lm_head.weight"
    for ours, theirs in (("embed_tokens.weight", "model.embed_tokens.weight"), ("lm_head.weight", head)):
        if theirs in state and not torch.equal(state[theirs].to(shared[ours].dtype).cpu(), shared[ours].cpu()):
            raise UserError(f"{folder}: {theirs} differs from the draft's: the draft belongs to another verifier")
    layer = draft.layer_state()
    if layout == "deepseek_v3" and head not in state:  # a fresh layer (--mtp-init random): vLLM loads its own head
        layer["shared_head.head.weight"] = shared["lm_head.weight"]
    if layout == "mimo":  # the whole layer is ours; DeepSeek-V3's layer also holds the verifier's head/embedding
        state = {k: v for k, v in state.items() if not k.startswith(prefix)}
    else:
        stale = [k for k in state if k.startswith(prefix + "mlp.experts.") and k.removeprefix(prefix) not in layer]
        if stale:
            raise UserError(f"{folder}: {stale[0]} is not a tensor of this draft's layer (another expert layout)")
    merged = {**state, **{prefix + k: v for k, v in layer.items()}}
    out = cast_state(merged, info.dtype)
    for k in out:  # the router's correction bias (frozen) keeps the verifier's dtype (DeepSeek-V3: float32)
        if k.endswith("e_score_correction_bias") and k in state:
            out[k] = merged[k].to(state[k].dtype).cpu().contiguous()
    cfg["num_nextn_predict_layers"] = max(int(cfg.get("num_nextn_predict_layers") or 0), index + 1)
    cfg["torch_dtype"] = cfg["dtype"] = str(info.dtype).removeprefix("torch.")
    return cfg, out


def companions(verifier_name: str) -> list[Path]:
    """The verifier's files copied beside the stitched checkpoint (tokenizer, generation config ...)."""
    folder = verifier_folder(verifier_name)
    return sorted(p for p in folder.iterdir()
                  if p.is_file() and p.name not in SKIP and not p.name.endswith((".safetensors", ".bin")))


def detect(cfg: Mapping[str, Any]) -> bool:
    return bool(set(ARCHITECTURES.values()) & set(cfg.get("architectures") or [])) \
        and int(cfg.get("num_nextn_predict_layers") or 0) > 0


def read(directory: Path, raw: Mapping[str, Any], tensors: dict[str, torch.Tensor]):
    where = f"{Path(directory) / 'config.json'} (a verifier with MTP layers)"
    require(raw, ["num_nextn_predict_layers"], where)
    kwargs = {**draft_kwargs(raw, where), "aux_layer_ids": [int(raw["num_hidden_layers"])]}  # the last state
    prefix = layer_prefix(kwargs)
    embed = tensors.get("model.embed_tokens.weight")
    if embed is None:
        raise UserError(f"{directory} has no model.embed_tokens.weight")
    state = {"embed_tokens.weight": embed, "lm_head.weight": tensors.get("lm_head.weight", embed)}
    layer = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    state.update(layer_from_tensors(kwargs, layer, f"{directory} ({prefix}*)"))
    state["d2t"] = torch.zeros(kwargs["vocab_size"], dtype=torch.long)
    state["t2d"] = torch.ones(kwargs["vocab_size"], dtype=torch.bool)
    # the folder is a whole verifier (the same weights as the one the layer was trained on)
    return kwargs, state, {"verifier": {"name_or_path": str(Path(directory).resolve()),
                                        "architectures": list(raw.get("architectures") or [])}}


def recorded(directory: Path, raw: Mapping[str, Any]) -> dict[str, Any]:
    """The folder is the verifier itself (vLLM serves it); its config records no number of speculative tokens."""
    return {"verifier": {"name_or_path": str(Path(directory).resolve())}}


def vllm_speculative_config(folder: str, k: int) -> dict[str, Any]:
    return {"method": "mtp", "num_speculative_tokens": int(k)}


def serve(verifier_name: str, folder: str, k: int) -> str:
    return f"vllm serve {folder} --speculative-config '{json.dumps(vllm_speculative_config(folder, k))}'"


def card(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    layout = kwargs.get("layout", "mimo")
    rows = [("MTP layer", f"{layer_prefix(kwargs)[:-1]} ({layout} layout, qkv bias {kwargs['qkv_bias']})"),
            ("hidden / intermediate", f"{kwargs['hidden_size']} / {kwargs['intermediate_size']}"),
            ("attention heads / kv heads / head dim",
             f"{kwargs['num_attention_heads']} / {kwargs['num_key_value_heads']} / {kwargs['head_dim']}"),
            ("reads", f"the verifier's last hidden state (layer {kwargs['num_hidden_layers'] - 1} output, pre-norm)")]
    return {"title": "Verifier with a fine-tuned MTP layer", "library": "vllm", "tags": ["mtp", layout],
            "about": "The verifier's checkpoint with its multi-token-prediction layer fine-tuned for speculative "
                     "decoding,", "rows": rows}


FORMAT = DraftFormat(name="verifier-mtp", write=write, detect=detect, read=read, serve=serve, card=card,
                     vllm_speculative_config=vllm_speculative_config, companions=companions, recorded=recorded)
