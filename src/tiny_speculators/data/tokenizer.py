"""The verifier's tokenizer for ``prepare``: a tokenizer-only folder (no ``config.json``) is enough.

``prepare`` never needs the weights, so ``--verifier`` may name a folder that holds only the
tokenizer files (``tokenizer.json`` / ``tokenizer_config.json`` ...). Stages that run the model
(``extract``, ``train``, ``evaluate``, ``regenerate``) still refuse such a folder in one line.

    from tiny_speculators.data.tokenizer import load_prepare_tokenizer
    tokenizer = load_prepare_tokenizer("path/to/tokenizer-only-folder")
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tiny_speculators.errors import UserError
from tiny_speculators.verifier import load
from tiny_speculators.verifier.describe import text_config
from tiny_speculators.verifier.embedded import EMBEDDED

log = logging.getLogger(__name__)

__all__ = ["load_prepare_tokenizer", "model_vocab_size", "tokenizer_only_folder"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tekken.json")


def tokenizer_only_folder(verifier: str | Path) -> Path | None:
    """The folder, if ``verifier`` is a local folder without ``config.json``; a folder with neither is an error."""
    if str(verifier) in EMBEDDED:
        return None
    path = Path(verifier).expanduser()
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise UserError(f"verifier folder {path} holds neither a model (config.json) nor a tokenizer "
                        f"({', '.join(_TOKENIZER_FILES[:2])})")
    return path


def load_prepare_tokenizer(verifier: str | Path, trust_remote_code: bool = False) -> Any:
    """The tokenizer of a hub id, an embedded name, a model folder or a tokenizer-only folder."""
    folder = tokenizer_only_folder(verifier)
    if folder is None:
        return load.load_tokenizer(verifier, trust_remote_code=trust_remote_code)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"could not load the tokenizer in {folder}: {message}") from None


def model_vocab_size(verifier: str | Path, trust_remote_code: bool = False) -> int | None:
    """``config.vocab_size`` of the verifier (the embedding rows, often > len(tokenizer)), if readable."""
    if tokenizer_only_folder(verifier) is not None:
        return None
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(load.resolve_verifier(verifier), trust_remote_code=trust_remote_code)
    except Exception as e:  # no network for a hub id, an unknown architecture
        log.debug("no model config for %s (%s)", verifier, e)
        return None
    config = text_config(config)
    size = getattr(config, "vocab_size", None)
    return int(size) if isinstance(size, int) else None
