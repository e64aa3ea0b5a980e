"""Load a draft of any family from any format we know: ours (``draft_config.json``, a train output folder)
or a family's published formats (``config.json`` + weights: vLLM speculators, SGLang, ...).

Formats that leave the verifier's (frozen, shared) embeddings out get them from the verifier: ``verifier=``
or the ``name_or_path`` the format records. ``train --init-from``, ``export`` and ``evaluate`` use this.

    from tiny_speculators.models.importing import import_draft
    draft, config = import_draft("runs/export", verifier="smollm2-135m")
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.models.checkpoint import CONFIG as DRAFT_CONFIG
from tiny_speculators.models.checkpoint import load_draft, materialize
from tiny_speculators.models.files import read_json

log = logging.getLogger(__name__)

OURS = "tiny-speculators"

__all__ = ["OURS", "check_vocab_maps", "copy_verifier_weights", "detect_format", "import_draft", "read_weights",
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
    from tiny_speculators.models import FAMILIES, get_family
    from tiny_speculators.models.checkpoint import read_draft_config

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


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int, vocab_size: int) -> torch.Tensor:
    """Validate ``d2t``/``t2d`` against each other; returns the draft->target id table (sorted target ids)."""
    if d2t.shape != (draft_vocab_size,) or t2d.shape != (vocab_size,):
        raise UserError(f"vocab maps have shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)}; the draft needs "
                        f"({draft_vocab_size},) and ({vocab_size},)")
    target_ids = torch.arange(draft_vocab_size) + d2t.long().cpu()
    if not torch.equal(target_ids, torch.nonzero(t2d.cpu().bool()).flatten()):
        raise UserError("d2t and t2d disagree: draft id i must map to the i-th selected target id")
    return target_ids


def copy_verifier_weights(draft: nn.Module, d2t: torch.Tensor, t2d: torch.Tensor,
                          embed_weight: torch.Tensor | None = None, lm_head_weight: torch.Tensor | None = None) -> None:
    """Into a fresh draft: the vocabulary maps (checked), the verifier's embeddings when given, and the rows of the
    verifier's lm_head (its full ``[V, H]`` matrix, when given) that the draft vocabulary selects."""
    target_ids = check_vocab_maps(d2t, t2d, draft.draft_vocab_size, draft.embed_tokens.num_embeddings)
    if embed_weight is not None and embed_weight.shape != draft.embed_tokens.weight.shape:
        raise UserError(f"verifier embeddings have shape {tuple(embed_weight.shape)}, the draft needs "
                        f"{tuple(draft.embed_tokens.weight.shape)}")
    if lm_head_weight is not None and lm_head_weight.shape != (draft.embed_tokens.num_embeddings, draft.hidden_size):
        raise UserError(f"verifier lm_head has shape {tuple(lm_head_weight.shape)}, expected "
                        f"({draft.embed_tokens.num_embeddings}, {draft.hidden_size})")
    with torch.no_grad():
        draft.d2t.copy_(d2t.long())
        draft.t2d.copy_(t2d.bool())
        if embed_weight is not None:
            draft.embed_tokens.weight.copy_(embed_weight)
        if lm_head_weight is not None:
            draft.lm_head.weight.copy_(lm_head_weight[target_ids.to(lm_head_weight.device)])


def _embeddings(verifier: str | None, directory: Path) -> torch.Tensor:
    from tiny_speculators.verifier.describe import verifier_embeddings

    if not verifier:
        raise UserError(f"{directory} holds no embed_tokens.weight (the draft shares its verifier's): pass the "
                        "verifier (a local folder, an embedded name or a cached hub id) to import it")
    try:
        return verifier_embeddings(verifier)
    except (OSError, UserError) as e:
        raise UserError(f"{directory} holds no embed_tokens.weight and the embeddings of verifier {verifier!r} "
                        f"could not be read ({e}); pass a local copy of the verifier") from None


def _lm_head(verifier: str | None, directory: Path) -> torch.Tensor:
    from tiny_speculators.verifier.head import load_verifier_head

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


def _check_verifier(draft: nn.Module, verifier: str | None) -> Any:
    from tiny_speculators.models.compat import check_against_verifier
    from tiny_speculators.verifier.describe import verifier_config

    if not verifier:
        return None
    config = verifier_config(verifier)
    if config is not None:
        check_against_verifier(draft.kwargs, config, verifier)
    return config


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
        _check_verifier(draft, verifier)
        return draft, {**config, "source": {"format": OURS, "path": str(directory)}}

    raw_config = read_json(directory / "config.json")
    kwargs, state, record = fmt.read(directory, raw_config, read_weights(directory))
    recorded = dict(record.get("verifier") or {})
    verifier = verifier or recorded.get("name_or_path")
    if verifier and not recorded.get("name_or_path"):
        from tiny_speculators.verifier.describe import verifier_config

        recorded["name_or_path"] = verifier
        vcfg = verifier_config(verifier)
        recorded["architectures"] = list(getattr(vcfg, "architectures", None) or [])
        if kwargs.get("aux_layer_ids") is None and record.get("resolve_aux") and vcfg is not None:
            kwargs["aux_layer_ids"] = record["resolve_aux"](int(vcfg.num_hidden_layers))
    if kwargs.get("aux_layer_ids") is None:
        log.warning("%s records no aux layer ids and the verifier is unknown: aux_layer_ids left empty", directory)
    state = _complete_state(kwargs, state, directory, verifier)
    draft = materialize(family.model, kwargs, state, str(directory), device, dtype)
    _check_verifier(draft, verifier)
    config = {"model_type": family.name, "kwargs": draft.kwargs, "aux_layer_ids": draft.kwargs.get("aux_layer_ids"),
              "verifier": recorded, "source": {"format": fmt.name, "path": str(directory)},
              **({"speculative_tokens": record["speculative_tokens"]} if "speculative_tokens" in record else {})}
    return draft, config
