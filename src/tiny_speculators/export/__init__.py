"""Export drafts for vLLM (speculators format) and SGLang; import drafts from those formats.

    from tiny_speculators.export import export, import_draft
"""

from tiny_speculators.export.importers import import_draft
from tiny_speculators.export.stage import export

__all__ = ["export", "import_draft"]
