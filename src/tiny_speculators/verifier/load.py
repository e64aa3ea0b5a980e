"""Load a verifier (and its tokenizer) the way ``from_pretrained`` does, plus the embedded default.

``name`` is a Hugging Face id (``Qwen/Qwen3-8B``), a local folder, or an embedded name
(``smollm2-135m``). ``trust_remote_code`` stays off unless the caller asks for it.

    from tiny_speculators.verifier.load import load_verifier
    model, tokenizer = load_verifier("smollm2-135m")
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tiny_speculators.errors import UserError
from tiny_speculators.verifier.embedded import EMBEDDED, embedded_verifier_dir

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "fp32": torch.float32,
                                  "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                                  "float16": torch.float16, "fp16": torch.float16}


def resolve_verifier(name: str | Path) -> str:
    """What ``from_pretrained`` should be given for ``name``: a folder path or a hub id."""
    name = str(name)
    if name in EMBEDDED:
        return str(embedded_verifier_dir(name))
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file():
                raise UserError(f"verifier folder {path} has no config.json: it holds only a tokenizer, enough for "
                                "prepare and vocab; this stage needs the model")
            raise UserError(f"verifier folder {path} has no config.json")
        return str(path)
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise UserError(f"verifier folder {name} does not exist")
    return name  # a hub id


def verifier_id(name: str | Path) -> str:
    """The id recorded in manifests and exported configs: the hub id behind an embedded name."""
    name = str(name)
    return EMBEDDED[name].hf_id if name in EMBEDDED else name


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r} (use one of {', '.join(DTYPES)})")
    return DTYPES[dtype]


def load_tokenizer(name: str | Path, trust_remote_code: bool = False):
    """The verifier's tokenizer (with its chat template)."""
    from transformers import AutoTokenizer

    source = resolve_verifier(name)
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise UserError(f"could not load the tokenizer of verifier {name!r}: {e}") from None


def check_not_quantized(name: str | Path, config) -> None:
    """A one-line :class:`UserError` for a quantized checkpoint (``quantization_config`` in its config)."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        text = getattr(config, "get_text_config", lambda: None)()
        quantization = getattr(text, "quantization_config", None)
    if not quantization:
        return
    method = (quantization.get("quant_method") if isinstance(quantization, dict)
              else getattr(quantization, "quant_method", None)) or "quantized"
    raise UserError(f"verifier {str(name)!r} is a {method} checkpoint, which this stage cannot run exactly in "
                    "transformers: extract its hidden states with --backend vllm, and measure drafts through vLLM "
                    "(benchmark)")


def model_class(config, causal_lm: type) -> type:
    """``AutoModelForImageTextToText`` for a vision-language config that is not also a causal LM (Qwen2.5-VL,
    Qwen3-VL: their ``...ForConditionalGeneration`` runs the vision tower and the decoder), else ``causal_lm``."""
    from transformers import AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    kind = type(config)
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING and kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return AutoModelForImageTextToText
    return causal_lm


def load_verifier(name: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
                  trust_remote_code: bool = False, with_tokenizer: bool = True):
    """Load the frozen verifier in eval mode with gradients off; returns ``(model, tokenizer)``.

    A quantized checkpoint is refused in one line: these stages compute with the full-precision weights, which
    ``transformers`` would only approximate; its hidden states come from vLLM (``extract --backend vllm``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    source = resolve_verifier(name)
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
        check_not_quantized(name, config)
        model = model_class(config, AutoModelForCausalLM).from_pretrained(
            source, dtype=parse_dtype(dtype), trust_remote_code=trust_remote_code
        )
    except OSError as e:
        raise UserError(f"could not load verifier {name!r}: {e}") from None
    except (ValueError, KeyError) as e:  # e.g. an architecture this transformers does not know
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"could not load verifier {str(name)!r}: {reason}") from None
    model.to(device).eval().requires_grad_(False)
    tokenizer = load_tokenizer(name, trust_remote_code) if with_tokenizer else None
    return model, tokenizer
