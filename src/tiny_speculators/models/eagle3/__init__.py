"""EAGLE-3 draft: model (``model.py``), builder, checkpoint I/O (``io.py``), TTT rollout (``ttt.py``,
masks and kernels in ``attention.py``) and its chunked loss + metrics (``loss.py``)."""

from tiny_speculators.models.eagle3.builder import build_draft, draft_kwargs_from_verifier
from tiny_speculators.models.eagle3.io import load_draft, save_draft
from tiny_speculators.models.eagle3.model import Eagle3Draft, Eagle3Output, KVCache

__all__ = [
    "Eagle3Draft",
    "Eagle3Output",
    "KVCache",
    "build_draft",
    "draft_kwargs_from_verifier",
    "load_draft",
    "save_draft",
]
