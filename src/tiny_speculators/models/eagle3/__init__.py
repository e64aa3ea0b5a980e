"""EAGLE-3 draft: model (``model.py``), builder, TTT rollout (``ttt.py``, masks and kernels in ``attention.py``),
its chunked loss + metrics (``loss.py``), the training objective (``objective.py``), the proposer the evaluator
drives (``proposer.py``), its formats (``speculators.py``, ``sglang.py``) and its table entry (``family.py``)."""

from tiny_speculators.models.eagle3.builder import build_draft, draft_kwargs_from_verifier
from tiny_speculators.models.eagle3.model import Eagle3Draft, Eagle3Output, KVCache

__all__ = ["Eagle3Draft", "Eagle3Output", "KVCache", "build_draft", "draft_kwargs_from_verifier"]
