"""EAGLE-3 draft: model (``model.py``), the training objective over the shared TTT rollout (``objective.py``;
``models/ttt.py``), the proposer the evaluator drives (``proposer.py``), its formats (``speculators.py``,
``sglang.py``) and its table entry with the builder (``family.py``; the start from verifier layers is shared:
``models/verifier_init.py``)."""

from tiny_speculators.models.eagle3.model import Eagle3Draft, Eagle3Output

__all__ = ["Eagle3Draft", "Eagle3Output"]
