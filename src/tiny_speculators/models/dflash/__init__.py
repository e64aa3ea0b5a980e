"""DFlash draft (block diffusion, KV injection): model (``model.py``), random-anchor block objective
(``objective.py``), the one-forward-per-step block proposer (``proposer.py``), its speculators format
(``speculators.py``) and its table entry (``family.py``)."""

from tiny_speculators.models.dflash.model import DFlashDraft

__all__ = ["DFlashDraft"]
