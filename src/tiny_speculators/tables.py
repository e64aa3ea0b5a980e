"""The summary table a stage prints when it is done: one row per name and value, with rich.

    from tiny_speculators.tables import print_summary_table
    print_summary_table("vocab -> runs/vocab", [("size", "8192"), ("coverage", "0.97")])
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from rich.console import Console
from rich.table import Table

__all__ = ["print_summary_table"]


def print_summary_table(title: str, rows: Iterable[tuple[str, ...]], *, header: tuple[str, ...] | None = None,
                        justify: Literal["left", "right"] = "left", stderr: bool = True) -> None:
    """Print ``rows`` (a name, then one or more values) under ``title``: with a ``header`` row (the columns' names)
    or none, the values justified ``justify``; on stderr (next to the logs) unless ``stderr`` is False."""
    table = Table(title=title, show_header=header is not None)
    if header is not None:
        table.add_column(header[0])
        for name in header[1:]:
            table.add_column(name, justify=justify)
    for row in rows:
        table.add_row(*row)
    Console(stderr=stderr).print(table)
