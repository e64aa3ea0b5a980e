"""DSpark draft (DFlash + Markov logit bias + confidence head): model (``model.py``), objective (``objective.py``,
its CE + TV + BCE loss), the confidence-cut block proposer (``proposer.py``), its speculators format
(``speculators.py``) and its table entry (``family.py``)."""

from tiny_speculators.models.dspark.model import DSparkDraft

__all__ = ["DSparkDraft"]
