"""Read a draft of any family from any format we know: ours (``draft_config.json``, a train output folder)
or a family's published formats (``config.json`` + weights: vLLM speculators, SGLang, ...). The one home of
reading: resolve the folder, tell its format, read its config and weights, rebuild the module; checking it
against a verifier is ``compat.py``, writing our own checkpoints ``checkpoint.py``.

Formats that leave the verifier's (frozen, shared) embeddings out get them from the verifier: ``verifier=``
or the ``name_or_path`` the format records. ``train --init-from``, ``export`` and ``evaluate`` use this.

    from tiny_speculators.models.importing import import_draft
    draft, config = import_draft("runs/export", verifier="smollm2-135m")
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.models import FAMILIES, get_family
from tiny_speculators.models.checkpoint import CONFIG as DRAFT_CONFIG
from tiny_speculators.models.checkpoint import WEIGHTS
from tiny_speculators.models.compat import check_verifier, check_vocab_maps
from tiny_speculators.models.family import DraftModel
from tiny_speculators.models.files import read_json, read_weights
from tiny_speculators.verifier.describe import verifier_config, verifier_embeddings
from tiny_speculators.verifier.head import load_verifier_head

log = logging.getLogger(__name__)

OURS = "tiny-speculators"

__all__ = ["OURS", "detect_format", "import_draft", "load_draft", "materialize", "read_draft_config",
           "resolve_checkpoint"]


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
                    "(a published draft format) and no best/, final/ or latest checkpoint inside")


def detect_format(directory: str | Path) -> tuple[Any, Any]:
    """``(family, format)`` of a draft folder; ``format`` is None for our own checkpoints."""
    directory = Path(directory)
    if (directory / DRAFT_CONFIG).is_file():
        return get_family(read_draft_config(directory)["model_type"]), None
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise UserError(f"{directory} is not a draft checkpoint: no {DRAFT_CONFIG} or config.json")
    config = read_json(config_path)
    for family in FAMILIES.values():
        for fmt in family.formats:
            if fmt.detect(config):
                return family, fmt
    known = ", ".join(f"{f.name}/{fmt.name}" for f in FAMILIES.values() for fmt in f.formats)
    raise UserError(f"{config_path} is not a draft config of a format we read ({known})")


def read_draft_config(directory: str | Path) -> dict[str, Any]:
    """``draft_config.json``, checked: a known ``model_type`` and ``kwargs``. Checkpoints written before the
    aux layer ids moved into ``kwargs`` are read as if they had."""
    path = Path(directory) / DRAFT_CONFIG
    if not path.is_file():
        raise UserError(f"{path} does not exist: not a draft checkpoint folder")
    config = read_json(path)
    if config.get("model_type") not in FAMILIES or not isinstance(config.get("kwargs"), dict):
        raise UserError(f"{path} is not a draft config: needs 'kwargs' and a model_type among "
                        f"{', '.join(FAMILIES)} (got {config.get('model_type')!r})")
    if config["kwargs"].get("aux_layer_ids") is None and config.get("aux_layer_ids") is not None:
        config["kwargs"]["aux_layer_ids"] = list(config["aux_layer_ids"])
    config["aux_layer_ids"] = config["kwargs"].get("aux_layer_ids")
    return config


def materialize(model_cls: type[nn.Module], kwargs: Mapping[str, Any], state: Mapping[str, torch.Tensor],
                where: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> DraftModel:
    """``model_cls(**kwargs)`` filled with ``state`` without random initialization (built on the meta device);
    a state that does not match the config names the missing / unexpected tensors and bad shapes."""
    with torch.device("meta"):
        draft = model_cls(**kwargs)
    expected = draft.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise UserError(f"the weights in {where} do not match its config: missing {missing}, unexpected {unexpected}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise UserError(f"{where}: tensor {name} has shape {tuple(tensor.shape)}, its config implies "
                            f"{tuple(expected[name].shape)}")
    state = {k: v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device) for k, v in state.items()}
    draft.load_state_dict(state, strict=True, assign=True)
    draft.after_load(device)  # rebuild non-persistent buffers (made on the meta device), re-freeze shared weights
    if any(t.is_meta for t in list(draft.parameters()) + list(draft.buffers())):
        raise RuntimeError(f"draft from {where} still has tensors on the meta device")
    return draft.to(device)


def load_draft(directory: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the draft saved by ``checkpoint.save_draft``; floating weights in ``dtype``, maps kept int64/bool."""
    directory = Path(directory)
    config = read_draft_config(directory)
    weights = directory / WEIGHTS
    if not weights.is_file():
        raise UserError(f"{weights} does not exist: the draft checkpoint is incomplete")
    family = get_family(config["model_type"])
    state = load_file(str(weights), device="cpu")
    draft = materialize(family.model, config["kwargs"], state, str(weights), device, dtype)
    return draft, config


def _embeddings(verifier: str | None, directory: Path) -> torch.Tensor:
    if not verifier:
        raise UserError(f"{directory} holds no embed_tokens.weight (the draft shares its verifier's): pass the "
                        "verifier (a local folder, an embedded name or a cached hub id) to import it")
    try:
        return verifier_embeddings(verifier)
    except (OSError, UserError) as e:
        raise UserError(f"{directory} holds no embed_tokens.weight and the embeddings of verifier {verifier!r} "
                        f"could not be read ({e}); pass a local copy of the verifier") from None


def _lm_head(verifier: str | None, directory: Path) -> torch.Tensor:
    if not verifier:
        raise UserError(f"{directory} holds no lm_head.weight (the draft shares its verifier's): pass the verifier")
    return load_verifier_head(verifier).target_head.lm_head.weight.detach().float().clone()


def _complete_state(kwargs: dict[str, Any], state: dict[str, torch.Tensor], directory: Path,
                    verifier: str | None) -> dict[str, torch.Tensor]:
    """Shared embeddings (and a shared full-vocab lm_head) from the verifier, and identity / derived vocab maps,
    where the files hold none."""
    vocab, draft_vocab = kwargs["vocab_size"], kwargs.get("draft_vocab_size", kwargs["vocab_size"])
    if "embed_tokens.weight" not in state:
        state["embed_tokens.weight"] = _embeddings(verifier, directory)
    if "lm_head.weight" not in state and draft_vocab == vocab:  # a format that shares the verifier's full head
        state["lm_head.weight"] = _lm_head(verifier, directory)
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
    return state


def import_draft(
    path: str | Path,
    *,
    verifier: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[nn.Module, dict[str, Any]]:
    """Load the draft in ``path`` (our checkpoint, or a family's published format).

    Args:
        path: a draft folder or a train output folder.
        verifier: the verifier the draft runs on (name, folder or hub id). Checked against the draft's
            hidden and vocab sizes when its config can be read; used for the embeddings when the files
            hold none. Defaults to the ``name_or_path`` the format records.
        device, dtype: where the draft lives and its floating-point dtype (vocab maps stay int64/bool).

    Returns:
        ``(draft, config)`` with ``config`` shaped like ``draft_config.json``: ``model_type``, ``kwargs``
        (with ``aux_layer_ids``), ``aux_layer_ids``, ``verifier`` {``name_or_path``, ``architectures``,
        ``hidden_size``, ``vocab_size``}, plus ``source`` {``format``, ``path``} and, when the format records it,
        ``speculative_tokens``.
    """
    directory = resolve_checkpoint(path)
    family, fmt = detect_format(directory)
    if fmt is None:
        draft, config = load_draft(directory, device=device, dtype=dtype)
        check_verifier(draft.kwargs, verifier)
        return draft, {**config, "source": {"format": OURS, "path": str(directory)}}

    raw_config = read_json(directory / "config.json")
    kwargs, state, record = fmt.read(directory, raw_config, read_weights(directory))
    recorded = dict(record.get("verifier") or {})
    verifier = verifier or recorded.get("name_or_path")
    if verifier and not recorded.get("name_or_path"):
        recorded["name_or_path"] = verifier
        vcfg = verifier_config(verifier)
        recorded["architectures"] = list(getattr(vcfg, "architectures", None) or [])
        if kwargs.get("aux_layer_ids") is None and record.get("resolve_aux") and vcfg is not None:
            kwargs["aux_layer_ids"] = record["resolve_aux"](int(vcfg.num_hidden_layers))
    if kwargs.get("aux_layer_ids") is None:
        log.warning("%s records no aux layer ids and the verifier is unknown: aux_layer_ids left empty", directory)
    state = _complete_state(kwargs, state, directory, verifier)
    draft = materialize(family.model, kwargs, state, str(directory), device, dtype)
    check_verifier(draft.kwargs, verifier)
    config = {"model_type": family.name, "kwargs": draft.kwargs, "aux_layer_ids": draft.kwargs.get("aux_layer_ids"),
              "verifier": recorded, "source": {"format": fmt.name, "path": str(directory)},
              **({"speculative_tokens": record["speculative_tokens"]} if "speculative_tokens" in record else {})}
    return draft, config
