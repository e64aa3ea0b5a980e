"""MTP: fine-tune a verifier's own multi-token-prediction layer. The layer (``model.py``; the DeepSeek-V3 layout's
MLA/MoE block in ``deepseek.py``), reading it from the verifier's safetensors (``weights.py``), the recursive K-step
objective (``objective.py``), the chain proposer (``proposer.py``), the stitched verifier checkpoint vLLM serves
with ``method: mtp`` (``stitched.py``) and the table entry (``family.py``)."""

from tiny_speculators.models.mtp.model import MTPDraft

__all__ = ["MTPDraft"]
