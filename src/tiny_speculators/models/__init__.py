"""Draft model families. Each algorithm is one sub-package (``eagle3/``, ``peagle/``, ``dflash/``, ``dspark/``,
``mtp/``) with the same files for the same roles: ``model.py``, ``family.py`` (options, build, table entry),
``objective.py``, ``proposer.py`` and its formats (``speculators.py``; EAGLE-3 adds ``sglang.py``, MTP writes
``stitched.py``). :data:`FAMILIES` is the one table the stages dispatch through (what a family provides, and what
they use of a draft: ``family.py``).

A family folder imports the family-neutral parts directly under ``models/`` (``layers.py``, ``attention.py``,
``shape.py``, ``ttt.py``, ``metrics.py``, ``losses.py``, ``chain.py``, ``speculators_format.py`` ...), never another
family's folder, with one exception by design: DSpark builds on DFlash (``dspark/`` subclasses its draft, reuses its
block objective, proposer and speculators format, and warm-starts from DFlash drafts).

    from tiny_speculators.models import FAMILIES, get_family
    get_family("eagle3").options()          # Eagle3Options(ttt_steps=3, ...)
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.models.dflash.family import FAMILY as DFLASH
from tiny_speculators.models.dspark.family import FAMILY as DSPARK
from tiny_speculators.models.eagle3.family import FAMILY as EAGLE3
from tiny_speculators.models.family import DraftFamily
from tiny_speculators.models.mtp.family import FAMILY as MTP
from tiny_speculators.models.peagle.family import FAMILY as PEAGLE

FAMILIES: dict[str, DraftFamily] = {
    "eagle3": EAGLE3,
    "peagle": PEAGLE,
    "dflash": DFLASH,
    "dspark": DSPARK,
    "mtp": MTP,
}

Algorithm = Literal[tuple(FAMILIES)]  # the names, for typed stage options
DEFAULT_ALGORITHM = next(iter(FAMILIES))  # the first in the table

__all__ = ["DEFAULT_ALGORITHM", "FAMILIES", "FORMAT_NAMES", "Algorithm", "DraftFamily", "family_of", "get_family"]


def get_family(name: str) -> DraftFamily:
    if name not in FAMILIES:
        raise UserError(f"unknown draft family {name!r} (known: {', '.join(FAMILIES)})")
    return FAMILIES[name]


def family_of(draft: nn.Module) -> DraftFamily:
    """The family whose model class ``draft`` is (exact class, so a subclass family is told apart)."""
    for family in FAMILIES.values():
        if type(draft) is family.model:
            return family
    raise UserError(f"{type(draft).__name__} is not the model of any draft family ({', '.join(FAMILIES)})")


FORMAT_NAMES = tuple(dict.fromkeys(fmt.name for family in FAMILIES.values() for fmt in family.formats))
