"""Export drafts in the formats servers load (each family's formats: vLLM speculators, SGLang, ...).

    from tiny_speculators.export import export, import_draft
"""

from tiny_speculators.export.stage import export
from tiny_speculators.models.importing import import_draft

__all__ = ["export", "import_draft"]
