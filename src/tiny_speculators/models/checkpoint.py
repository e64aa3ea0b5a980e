"""Writing our draft checkpoints, for every family: ``model.safetensors`` + ``draft_config.json``
(``{"model_type": <family>, "kwargs": {...}, **meta}``); ``kwargs`` rebuild the module and include the
verifier layers it reads (``aux_layer_ids``). Reading them back (and every other format) is ``importing.py``.

    save_draft(out / "step_000200", draft, {"verifier": {...}, "trained_with": {...}})
    draft, config = load_draft(out / "step_000200")      # from tiny_speculators.models.importing
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from tiny_speculators.atomic import atomic_write
from tiny_speculators.errors import UserError
from tiny_speculators.models import family_of
from tiny_speculators.models.family import DraftModel

WEIGHTS = "model.safetensors"
CONFIG = "draft_config.json"

__all__ = ["CONFIG", "WEIGHTS", "save_draft"]


def save_draft(directory: str | Path, draft: DraftModel, meta: dict[str, Any] | None = None) -> Path:
    """Write ``model.safetensors`` and ``draft_config.json`` into ``directory`` (each atomically).

    ``meta`` is merged into the config; callers pass at least ``verifier``
    (``{"name_or_path", "architectures", "hidden_size", "vocab_size"}``), which export needs.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in draft.state_dict().items()}
    atomic_write(directory / WEIGHTS, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    config = {"model_type": family_of(draft).name, "kwargs": draft.kwargs, **(meta or {})}
    own, given = draft.kwargs.get("aux_layer_ids"), config.get("aux_layer_ids")
    if own is not None and given is not None and list(own) != list(given):
        raise UserError(f"meta aux_layer_ids {given} disagree with the draft's own {own}")
    text = json.dumps(config, indent=2, sort_keys=False) + "\n"
    atomic_write(directory / CONFIG, lambda tmp: Path(tmp).write_text(text))
    return directory
