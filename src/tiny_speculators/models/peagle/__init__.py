"""P-EAGLE draft (parallel drafting): model (``model.py``), COD-sampled training objective (``objective.py``),
the one-forward-per-step proposer (``proposer.py``), its speculators format (``speculators.py``) and its table
entry (``family.py``)."""

from tiny_speculators.models.peagle.model import PEagleDraft

__all__ = ["PEagleDraft"]
