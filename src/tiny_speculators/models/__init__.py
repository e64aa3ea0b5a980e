"""Draft model families. Each algorithm is one sub-package (``eagle3``) with its modules, builder and loss."""
