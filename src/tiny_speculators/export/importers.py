"""Load an EAGLE-3 draft from any of the formats we know into our :class:`Eagle3Draft`.

* our checkpoints: a folder with ``draft_config.json`` (``train`` output: ``step_000200/``, ``best/``,
  ``final/``), or the train output folder itself (``best/`` is used, then ``final/``, then ``latest``);
* the vLLM speculators format (``config.json`` with ``speculators_model_type: "eagle3"``);
* the SafeAILab EAGLE-3 / SGLang format (``LlamaForCausalLMEagle3``, ``midlayer.*`` names,
  ``model.safetensors`` or ``pytorch_model.bin``).

Formats that leave the (frozen) embeddings out get them from the verifier: ``verifier=`` or, for the
speculators format, the ``name_or_path`` it records. ``train --init-from`` and ``evaluate`` use this.

    from tiny_speculators.export.importers import import_draft
    draft, config = import_draft("runs/export", verifier="smollm2-135m")
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

import torch

from tiny_speculators.errors import UserError
from tiny_speculators.export import sglang, speculators
from tiny_speculators.export.common import (
    check_against_verifier,
    read_json,
    verifier_config,
    verifier_embeddings,
)
from tiny_speculators.models.eagle3.builder import check_vocab_maps
from tiny_speculators.models.eagle3.io import CONFIG as DRAFT_CONFIG
from tiny_speculators.models.eagle3.io import load_draft
from tiny_speculators.models.eagle3.model import Eagle3Draft

log = logging.getLogger(__name__)

Format = Literal["tiny-speculators", "speculators", "eagle3-sglang"]

__all__ = ["detect_format", "import_draft", "read_weights", "resolve_checkpoint"]


def resolve_checkpoint(path: str | Path) -> Path:
    """The folder that holds the draft: ``path`` itself, or ``best/``, ``final/``, ``latest`` inside a train output."""
    path = Path(path).expanduser()
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise UserError(f"checkpoint {path} is a file; give the folder that holds it")
    if (path / DRAFT_CONFIG).is_file() or (path / "config.json").is_file():
        return path
    for name in ("best", "final", "latest"):
        candidate = path / name
        if candidate.is_file():  # a pointer file naming the checkpoint folder
            candidate = path / candidate.read_text().strip()
        if (candidate / DRAFT_CONFIG).is_file():
            log.info("using checkpoint %s", candidate)
            return candidate
    raise UserError(f"{path} is not a draft checkpoint: it has no {DRAFT_CONFIG} (ours), no config.json "
                    "(speculators or SGLang format) and no best/, final/ or latest checkpoint inside")


def detect_format(directory: str | Path) -> Format:
    directory = Path(directory)
    if (directory / DRAFT_CONFIG).is_file():
        return "tiny-speculators"
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise UserError(f"{directory} is not a draft checkpoint: no {DRAFT_CONFIG} or config.json")
    config = read_json(config_path)
    if speculators.is_speculators_config(config):
        return "speculators"
    if sglang.is_sglang_config(config):
        return "eagle3-sglang"
    raise UserError(f"{config_path} is not an EAGLE-3 draft config: it has neither speculators_model_type "
                    f"(speculators format) nor architectures [{sglang.ARCHITECTURE!r}] (SGLang format)")


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF-style folder: ``model.safetensors``, sharded safetensors, or ``pytorch_model.bin``."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if (directory / "model.safetensors").is_file():
        return load_file(str(directory / "model.safetensors"))
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(read_json(index)["weight_map"].values())):
            state.update(load_file(str(directory / shard)))
        return state
    if (directory / "pytorch_model.bin").is_file():
        state = torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise UserError(f"{directory / 'pytorch_model.bin'} does not hold a state dict")
        return state
    raise UserError(f"{directory} has no weights (model.safetensors, model.safetensors.index.json or "
                    "pytorch_model.bin)")


def _embeddings(verifier: str | None, directory: Path) -> torch.Tensor:
    if not verifier:
        raise UserError(f"{directory} holds no embed_tokens.weight (the draft shares its verifier's): pass the "
                        "verifier (a local folder, an embedded name or a cached hub id) to import it")
    try:
        return verifier_embeddings(verifier)
    except (OSError, UserError) as e:
        raise UserError(f"{directory} holds no embed_tokens.weight and the embeddings of verifier {verifier!r} "
                        f"could not be read ({e}); pass a local copy of the verifier") from None


def _assemble(kwargs: dict[str, Any], state: dict[str, torch.Tensor], directory: Path, verifier: str | None,
              device: str | torch.device, dtype: torch.dtype) -> Eagle3Draft:
    """Fill a draft built from ``kwargs`` with ``state``; embeddings / identity vocab maps added when absent."""
    vocab, draft_vocab = kwargs["vocab_size"], kwargs["draft_vocab_size"]
    if "embed_tokens.weight" not in state:
        state["embed_tokens.weight"] = _embeddings(verifier, directory)
    if "d2t" not in state and "t2d" not in state:
        if draft_vocab != vocab:
            raise UserError(f"{directory} has a draft vocab of {draft_vocab} tokens (verifier: {vocab}) but no "
                            "d2t/t2d maps")
        state["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
        state["t2d"] = torch.ones(vocab, dtype=torch.bool)
    elif "t2d" not in state:  # t2d follows from d2t
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[torch.arange(draft_vocab) + state["d2t"].long()] = True
        state["t2d"] = t2d
    state["d2t"], state["t2d"] = state["d2t"].long(), state["t2d"].bool()
    check_vocab_maps(state["d2t"], state["t2d"], draft_vocab, vocab)

    with torch.device("meta"):
        draft = Eagle3Draft(**kwargs)
    expected = draft.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise UserError(f"the weights in {directory} do not match its config: missing {missing}, "
                        f"unexpected {unexpected}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise UserError(f"{directory}: tensor {name} has shape {tuple(tensor.shape)}, its config implies "
                            f"{tuple(expected[name].shape)}")
    state = {k: v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device) for k, v in state.items()}
    draft.load_state_dict(state, strict=True, assign=True)
    # Non-persistent buffers (RoPE frequencies) were created on the meta device: rebuild them, as load_draft does.
    draft.rotary = draft.rotary.__class__(kwargs["head_dim"], kwargs["rope_parameters"],
                                          kwargs["max_position_embeddings"]).to(device)
    if any(t.is_meta for t in list(draft.parameters()) + list(draft.buffers())):
        raise RuntimeError("imported draft still has tensors on the meta device")
    draft.embed_tokens.weight.requires_grad_(bool(kwargs.get("train_embeddings", False)))
    return draft.to(device)


def _check_verifier(kwargs: dict[str, Any], verifier: str | None, aux_layer_ids) -> Any:
    if not verifier:
        return None
    config = verifier_config(verifier)
    if config is not None:
        check_against_verifier(kwargs, config, verifier, aux_layer_ids)
    return config


def import_draft(
    path: str | Path,
    *,
    verifier: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[Eagle3Draft, dict[str, Any]]:
    """Load the EAGLE-3 draft in ``path`` (our checkpoint, speculators or SGLang format).

    Args:
        path: a draft folder or a train output folder.
        verifier: the verifier the draft runs on (name, folder or hub id). Checked against the draft's
            hidden and vocab sizes when its config can be read; used for the embeddings when the files
            hold none. For the speculators format it defaults to the recorded ``name_or_path``.
        device, dtype: where the draft lives and its floating-point dtype (vocab maps stay int64/bool).

    Returns:
        ``(draft, config)`` with ``config`` shaped like ``draft_config.json``: ``model_type``, ``kwargs``,
        ``aux_layer_ids``, ``verifier`` {``name_or_path``, ``architectures``, ``hidden_size``, ``vocab_size``},
        plus ``source`` {``format``, ``path``} and, when the format records it, ``speculative_tokens``.
    """
    directory = resolve_checkpoint(path)
    fmt = detect_format(directory)
    if fmt == "tiny-speculators":
        draft, config = load_draft(directory, device=device, dtype=dtype)
        _check_verifier(draft.kwargs, verifier, config.get("aux_layer_ids"))
        config = {**config, "source": {"format": fmt, "path": str(directory)}}
        return draft, config

    raw_state = read_weights(directory)
    if fmt == "speculators":
        cfg = speculators.read_config(directory)
        state = speculators.normalize_state(raw_state)
        fc = state.get("fc.weight")
        kwargs = speculators.draft_kwargs(cfg, fc.shape[1] if fc is not None else None)
        aux = cfg.get("eagle_aux_hidden_state_layer_ids")
        recorded = speculators.verifier_of(cfg)
        verifier = verifier or recorded["name_or_path"]
        extra = {"speculative_tokens": speculators.speculative_tokens_of(cfg)}
    else:
        cfg = sglang.read_config(directory)
        state = sglang.normalize_state(raw_state)
        if "fc.weight" not in state or "lm_head.weight" not in state:
            raise UserError(f"{directory} ({sglang.ARCHITECTURE} format) lacks fc.weight or lm_head.weight")
        rows = int(state["lm_head.weight"].shape[0])
        if cfg.get("draft_vocab_size") not in (None, rows):
            raise UserError(f"{directory}/config.json has draft_vocab_size {cfg['draft_vocab_size']} but "
                            f"lm_head.weight has {rows} rows")
        kwargs = sglang.draft_kwargs(cfg, rows, state["fc.weight"].shape[1])
        aux = None
        recorded = {"name_or_path": None, "architectures": [], "hidden_size": kwargs["target_hidden_size"],
                    "vocab_size": kwargs["vocab_size"]}
        extra = {}
    verifier_cfg = _check_verifier(kwargs, verifier, aux)
    if fmt == "eagle3-sglang":
        layers = getattr(verifier_cfg, "num_hidden_layers", None)
        aux = sglang.aux_layer_ids_of(cfg, int(layers) if layers else None)
        if aux is None:
            log.warning("%s records no aux layer ids and the verifier is unknown: aux_layer_ids left empty", directory)
        if verifier:
            recorded["name_or_path"] = verifier
            recorded["architectures"] = list(getattr(verifier_cfg, "architectures", None) or [])
    draft = _assemble(kwargs, state, directory, verifier, device, dtype)
    config = {"model_type": "eagle3", "kwargs": draft.kwargs, "aux_layer_ids": aux, "verifier": recorded,
              "source": {"format": fmt, "path": str(directory)}, **extra}
    return draft, config
