"""The ``evaluate`` stage: real speculative decoding in-process with Hugging Face ``transformers``.

Loads the verifier and a draft (our checkpoint, a train output folder, or an exported speculators /
SGLang folder), generates an answer to each prompt with draft + verifier (chain of ``k`` tokens or a
dynamic tree), times the verifier alone on the same prompts, and writes ``results.json``,
``summary.json``, ``acceptance.png`` and, for drafts that predict acceptance, ``calibration.png`` into ``out``.
Tiny CPU run on the embedded verifier::

    tiny-speculators evaluate --verifier smollm2-135m --draft runs/train/final --prompts chat \
        --out runs/eval --max-prompts 3 --max-new-tokens 32
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from tiny_speculators.atomic import write_json_atomic
from tiny_speculators.errors import UserError
from tiny_speculators.evaluate.decoding import (
    DecodeResult,
    TreeParams,
    autoregressive_generate,
    speculative_generate,
)
from tiny_speculators.evaluate.prompts import Prompt, load_prompts, render_image_prompt, render_prompt
from tiny_speculators.evaluate.report import (
    acceptance_metrics,
    calibration,
    print_table,
    save_calibration_plot,
    save_plot,
)
from tiny_speculators.evaluate.target import TargetRunner
from tiny_speculators.models import get_family
from tiny_speculators.models.family import ConfidenceProposer
from tiny_speculators.models.importing import import_draft
from tiny_speculators.sampling import SamplingParams
from tiny_speculators.verifier.describe import text_config
from tiny_speculators.verifier.load import load_verifier, parse_dtype, verifier_id

__all__ = ["evaluate"]

log = logging.getLogger(__name__)


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def evaluate(
    verifier: str,
    draft: Path,
    out: Path,
    prompts: str = "builtin",
    k: int | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    tree: bool = False,
    tree_depth: int = 5,
    tree_topk: int = 4,
    tree_total_tokens: int = 24,
    confidence_threshold: float | Literal["off"] = "off",
    dtype: Literal["float32", "bfloat16", "float16"] = "float32",
    device: str = "cpu",
    seed: int = 0,
    baseline: bool = True,
    max_prompts: int | None = None,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Measure a draft with real speculative decoding against its verifier.

    Args:
        verifier: the verifier: an embedded name (smollm2-135m), a local folder or a Hugging Face id.
        draft: a draft folder of any family: our checkpoint (draft_config.json), a train output folder, or an
            exported folder (speculators / SGLang format).
        out: output folder for results.json, summary.json and acceptance.png.
        prompts: built-in sets (builtin = chat, code and math interleaved; user; several comma-joined) or a
            JSONL file of {"prompt"} / {"messages"}.
        k: draft tokens per verification step (chain mode); default: what the draft records (its export's
            speculative tokens, or what it was trained for), else 3.
        max_new_tokens: generation length limit per prompt (generation also stops at EOS).
        temperature: 0 = greedy; > 0 samples, with rejection sampling keeping the verifier's distribution.
        top_p: nucleus sampling threshold (1 = off).
        top_k: top-k sampling filter (0 = off).
        tree: draft a tree instead of a chain (for families whose proposer drafts dynamic trees),
            verified in one forward with a tree mask (with temperature > 0 each node is verified by sampling the
            verifier: lossless, "target-only").
        tree_depth: tree levels (longest draft).
        tree_topk: children per expanded node and nodes expanded per level.
        tree_total_tokens: draft nodes sent to the verifier per step (root excluded).
        confidence_threshold: for drafts that predict each token's acceptance (a confidence head):
            send only the drafted prefix whose running product of confidences stays >= this (at least one token);
            off = verify every drafted token. Drafts with a confidence head also get calibration.png.
        dtype: verifier and draft dtype (exactness checks use float32).
        device: torch device (cpu, cuda, cuda:1, ...).
        seed: seed for sampling (prompt i uses seed + i).
        baseline: also time the verifier alone on the same prompts (the speed-up denominator).
        max_prompts: evaluate only the first N prompts.
        trust_remote_code: allow custom modelling code of the verifier.
    """
    _check_arguments(k, max_new_tokens, tree, tree_depth, tree_topk, tree_total_tokens)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    tree_params = TreeParams(tree_depth, tree_topk, tree_total_tokens) if tree else None
    torch_dtype = parse_dtype(dtype)
    prompt_list = load_prompts(prompts, max_prompts)

    model, tokenizer = load_verifier(verifier, dtype=torch_dtype, device=device, trust_remote_code=trust_remote_code)
    d = _load_draft(draft, verifier, model, k, confidence_threshold, tree, device, torch_dtype)
    target = TargetRunner(model, list(d.aux_layer_ids))
    decoding = _Decoding(target, d.proposer, d.k, params, _eos_ids(model, tokenizer), tree_params, max_new_tokens)
    encoded = _encode(prompt_list, verifier, tokenizer, target, torch_dtype, trust_remote_code)

    decoding.warm_up(encoded[0], seed, baseline)
    positions = tree_depth if tree else d.k
    t_start = time.perf_counter()
    per_prompt, spec_results, base_results = _decode_prompts(decoding, prompt_list, encoded, tokenizer, positions,
                                                             seed, baseline, dtype)
    target.close()

    summary: dict[str, Any] = {
        "verifier": verifier, "verifier_id": verifier_id(verifier), "draft": str(draft),
        "algorithm": d.family.name, "draft_format": d.config.get("source", {}).get("format"),
        "aux_layer_ids": list(d.aux_layer_ids),
        "prompts": prompts, "num_prompts": len(prompt_list),
        "mode": (f"tree (depth {tree_depth}, topk {tree_topk}, {tree_total_tokens} tokens)" if tree
                 else f"chain (k={d.k})"),
        "k": None if tree else d.k, "confidence_threshold": d.threshold,
        "tree": {"depth": tree_depth, "topk": tree_topk, "total_tokens": tree_total_tokens} if tree else None,
        "temperature": temperature, "top_p": top_p, "top_k": top_k, "max_new_tokens": max_new_tokens,
        "dtype": dtype, "device": device, "seed": seed,
        **_measures(spec_results, positions, t_start),
        **_against_baseline(spec_results, base_results, per_prompt, baseline, params.greedy),
    }
    _write_outputs(Path(out), summary, per_prompt, draft, verifier, d.threshold)
    print_table(summary)
    return summary


# a prompt as decoded: its token ids and, for a vision-language verifier's prompt with images, its image inputs
_Encoded = tuple[list[int], dict[str, torch.Tensor] | None]


def _encode(prompts: list[Prompt], verifier: str, tokenizer, target: TargetRunner, dtype: torch.dtype,
            trust_remote_code: bool) -> list[_Encoded]:
    """Each prompt's token ids; a prompt with images also gets its image inputs and M-RoPE positions."""
    if not any(p.images for p in prompts):
        return [(render_prompt(p, tokenizer), None) for p in prompts]
    from tiny_speculators.verifier.vision import Vision

    vision = Vision.load(verifier, trust_remote_code)
    if vision is None or target.parts.multimodal is None:
        raise UserError(f"prompt {next(p.id for p in prompts if p.images)} holds images, but verifier {verifier} "
                        "reads no images")
    encoded: list[_Encoded] = []
    for p in prompts:
        if not p.images:
            encoded.append((render_prompt(p, tokenizer), None))
            continue
        ids, images = render_image_prompt(p, vision)
        images["pixel_values"] = images["pixel_values"].to(dtype)
        images["position_ids"] = target.rope_positions(ids, images)
        encoded.append((ids, images))
    return encoded


def _check_arguments(k: int | None, max_new_tokens: int, tree: bool, tree_depth: int, tree_topk: int,
                     tree_total_tokens: int) -> None:
    if k is not None and k < 1:
        raise UserError(f"k must be at least 1, not {k}")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
    if tree and (tree_depth < 1 or tree_topk < 1 or tree_total_tokens < 1):
        raise UserError("tree_depth, tree_topk and tree_total_tokens must all be at least 1")


@dataclass
class _Draft:
    """A loaded draft, checked against its verifier: its family, config and proposer, and how it is run."""

    family: Any
    config: dict[str, Any]
    proposer: Any
    k: int
    aux_layer_ids: list[int]
    threshold: float | None


def _load_draft(draft: Path, verifier: str, model, k: int | None, confidence_threshold: float | Literal["off"],
                tree: bool, device: str, torch_dtype: torch.dtype) -> _Draft:
    draft_model, config = import_draft(draft, verifier=verifier, device=device, dtype=torch_dtype)
    draft_model.eval().requires_grad_(False)
    family = get_family(config["model_type"])
    k = family.resolve_speculative_tokens(config, given=k)
    n_layers = text_config(model.config).num_hidden_layers
    vocab = model.get_input_embeddings().weight.shape[0]
    if draft_model.kwargs["vocab_size"] != vocab:
        raise UserError(f"draft {draft} was built for a vocabulary of {draft_model.kwargs['vocab_size']} "
                        f"tokens, verifier {verifier} has {vocab}")
    aux_layer_ids = config.get("aux_layer_ids") or family.default_aux_layer_ids(n_layers)
    if not config.get("aux_layer_ids"):
        log.warning("draft %s records no aux layer ids; using the %s default %s", draft, family.name, aux_layer_ids)
    if max(aux_layer_ids) > n_layers:  # id N: the last layer's output (what some families read)
        raise UserError(f"draft {draft} reads verifier layers {aux_layer_ids}; verifier {verifier} has {n_layers}")
    proposer = family.proposer(draft_model)
    threshold = None if confidence_threshold == "off" else float(confidence_threshold)
    if threshold is not None:
        if not (isinstance(proposer, ConfidenceProposer) and proposer.has_confidence):
            raise UserError(f"--confidence-threshold: a {family.name} draft predicts no acceptance confidence "
                            "(use off)")
        if tree:
            raise UserError("--confidence-threshold cuts chains: evaluate without --tree")
        proposer.confidence_threshold = threshold
    if tree and not proposer.supports_tree:
        raise UserError(f"a {family.name} draft proposes chains only; evaluate it without --tree")
    return _Draft(family, config, proposer, k, aux_layer_ids, threshold)


@dataclass
class _Decoding:
    """One way of decoding every prompt: with the draft (speculative) or the verifier alone (the baseline)."""

    target: TargetRunner
    proposer: Any
    k: int
    params: SamplingParams
    eos: set[int]
    tree: TreeParams | None
    max_new_tokens: int

    def speculative(self, prompt: _Encoded, seed: int, max_new_tokens: int | None = None) -> DecodeResult:
        ids, images = prompt
        return speculative_generate(self.target, self.proposer, ids, k=self.k,
                                    max_new_tokens=max_new_tokens or self.max_new_tokens, params=self.params,
                                    eos_ids=self.eos, tree=self.tree, generator=torch.Generator().manual_seed(seed),
                                    images=images)

    def alone(self, prompt: _Encoded, seed: int, max_new_tokens: int | None = None) -> DecodeResult:
        ids, images = prompt
        return autoregressive_generate(self.target, ids, max_new_tokens=max_new_tokens or self.max_new_tokens,
                                       params=self.params, eos_ids=self.eos,
                                       generator=torch.Generator().manual_seed(seed), images=images)

    def warm_up(self, prompt: _Encoded, seed: int, baseline: bool) -> None:
        """Lazy allocations, kernel selection: so that the first timed prompt is not penalised."""
        self.speculative(prompt, seed, min(4, self.max_new_tokens))
        if baseline:
            self.alone(prompt, seed, min(4, self.max_new_tokens))


def _decode_prompts(decoding: _Decoding, prompt_list, encoded: list[_Encoded], tokenizer, positions: int, seed: int,
                    baseline: bool, dtype: str) -> tuple[list[dict[str, Any]], list[DecodeResult], list[DecodeResult]]:
    """Each prompt with the draft (and the verifier alone): per-prompt results.json entries and both decodings."""
    per_prompt: list[dict[str, Any]] = []
    spec_results: list[DecodeResult] = []
    base_results: list[DecodeResult] = []
    for i, (prompt, coded) in enumerate(zip(prompt_list, encoded, strict=True)):
        res = decoding.speculative(coded, seed + i)
        spec_results.append(res)
        entry: dict[str, Any] = {
            "id": prompt.id, "messages": prompt.messages, "prompt_tokens": len(coded[0]),
            "tokens": res.tokens, "text": tokenizer.decode(res.tokens, skip_special_tokens=True),
            "seconds": res.seconds, "verifier_forwards": res.verifier_forwards,
            "draft_forwards": res.draft_forwards,
            **acceptance_metrics(res.accepted, res.proposed, positions),
            **({"confidences": res.confidences} if res.confidences else {}),
        }
        if baseline:
            base = decoding.alone(coded, seed + i)
            base_results.append(base)
            entry["baseline_seconds"] = base.seconds
            entry["baseline_tokens"] = len(base.tokens)
            if decoding.params.greedy:
                entry["matches_baseline"] = base.tokens == res.tokens
                if not entry["matches_baseline"]:
                    log.warning("prompt %s: greedy output differs from the verifier alone (numerical ties in "
                                "%s?)", prompt.id, dtype)
        per_prompt.append(entry)
        log.info("prompt %d/%d %s: %d tokens, tau %.2f, %.1f tok/s", i + 1, len(prompt_list), prompt.id,
                 len(res.tokens), entry["acceptance_length"] or 1.0, len(res.tokens) / max(res.seconds, 1e-9))
    return per_prompt, spec_results, base_results


def _measures(spec_results: list[DecodeResult], positions: int, t_start: float) -> dict[str, Any]:
    """summary.json's measures of decoding with the draft, over all prompts."""
    metrics = acceptance_metrics([a for r in spec_results for a in r.accepted],
                                 [p for r in spec_results for p in r.proposed], positions)
    generated = sum(len(r.tokens) for r in spec_results)
    seconds = sum(r.seconds for r in spec_results)
    return {
        **metrics,
        "tokens_generated": generated, "seconds": seconds,
        "tokens_per_second": generated / seconds if seconds else None,
        "tokens_per_verifier_forward_incl_prefill": generated / sum(r.verifier_forwards for r in spec_results),
        # draft forward passes per verification step (the prompt's commit counted once per prompt)
        "draft_forwards_per_step": (sum(r.draft_forwards for r in spec_results)
                                    / max(1, sum(len(r.accepted) for r in spec_results))),
        "draft_ms_per_step": (1000 * sum(r.draft_seconds for r in spec_results)
                              / max(1, sum(len(r.accepted) for r in spec_results))),
        "wall_seconds": time.perf_counter() - t_start,
        "confidence_calibration": calibration([c for r in spec_results for c in r.confidences],
                                              [a for r in spec_results if r.confidences for a in r.accepted]),
    }


def _against_baseline(spec_results: list[DecodeResult], base_results: list[DecodeResult],
                      per_prompt: list[dict[str, Any]], baseline: bool, greedy: bool) -> dict[str, Any]:
    """The verifier alone's speed, the speed-up and (greedy) whether the outputs match; all None without a
    baseline."""
    if not baseline:
        return {"baseline_tokens_per_second": None, "speedup": None, "matches_baseline": None}
    generated = sum(len(r.tokens) for r in spec_results)
    seconds = sum(r.seconds for r in spec_results)
    tokens_per_second = generated / seconds if seconds else None
    base_tokens = sum(len(r.tokens) for r in base_results)
    base_seconds = sum(r.seconds for r in base_results)
    base_per_second = base_tokens / base_seconds if base_seconds else None
    return {"baseline_tokens_per_second": base_per_second,
            "speedup": tokens_per_second / base_per_second if base_per_second else None,
            "matches_baseline": all(e["matches_baseline"] for e in per_prompt) if greedy else None}


def _write_outputs(out: Path, summary: dict[str, Any], per_prompt: list[dict[str, Any]], draft: Path, verifier: str,
                   threshold: float | None) -> None:
    """results.json, summary.json, acceptance.png and (drafts with a confidence head) calibration.png."""
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "results.json", {**summary, "per_prompt": per_prompt})
    write_json_atomic(out / "summary.json", summary)
    save_plot(out / "acceptance.png", summary["per_position_acceptance"],
              [(e["id"], e["acceptance_length"]) for e in per_prompt],
              f"{Path(str(draft)).name} on {verifier_id(verifier)}: τ = {summary['acceptance_length'] or 1:.2f}")
    if summary["confidence_calibration"] is not None:
        save_calibration_plot(out / "calibration.png", summary["confidence_calibration"],
                              f"{Path(str(draft)).name} on {verifier_id(verifier)}: confidence calibration"
                              + (f" (threshold {threshold})" if threshold is not None else ""))
