"""What a draft family provides: the one seam between an algorithm and the stages that train, export,
evaluate and serve it.

A family is a frozen :class:`DraftFamily` of plain functions and types, listed in the one table in
``models/__init__.py``. ``train``, ``export``, ``evaluate`` and ``pipeline`` only ever go through it:

* **model**: the ``nn.Module`` class, rebuilt from its ``kwargs`` (which include the verifier layers it
  reads, ``aux_layer_ids``); saved as ``draft_config.json`` + safetensors by ``models/checkpoint.py``. What the
  stages use of a draft is :class:`DraftModel`.
* **options**: a frozen dataclass of the family's own training options (``train: {algorithm: peagle,
  peagle: {...}}`` in YAML, ``--peagle-<option>`` on the command line).
* **build**: a fresh draft from :class:`BuildInputs` (verifier config, vocab maps, embeddings) + options.
* **default_aux_layer_ids**: which verifier layers it needs when the user does not say (id ``i`` = the input of
  layer ``i``; id ``N`` = the last layer's output before the final norm); ``fixed_aux_layer_ids``: always those.
* **objective**: the training forward, an ``nn.Module`` satisfying :class:`Objective` (loss, metric sums,
  the counts that normalize the loss exactly across micro-batches and ranks, their summary).
* **proposer**: what ``evaluate`` drives during speculative decoding (:class:`Proposer`).
* **formats**: the on-disk formats it writes and reads (:class:`DraftFormat`; the first one is the default).
* **speculative_tokens**: the k its training options imply; :meth:`DraftFamily.resolve_speculative_tokens` is how
  export, evaluate and benchmark choose k (the user's, else the draft's record, else its training's, else a default).

    from tiny_speculators.models import get_family
    family = get_family("eagle3")
    draft = family.build(inputs, family.options())
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.options import options_from_record, options_record, parse_options
from tiny_speculators.sampling import SamplingParams

# options_record, parse_options: re-exported for tests/export/vllm_helpers.py; new code imports tiny_speculators.options
__all__ = ["DEFAULT_SPECULATIVE_TOKENS", "DRAFT_KWARGS", "BuildInputs", "ConfidenceProposer", "DraftFamily",
           "DraftFormat", "DraftModel", "DraftTree", "ExportInfo", "Objective", "Proposer", "StepOutput", "TreeParams",
           "mask_token_of", "options_record", "parse_options", "resolve_layer_type"]

DEFAULT_SPECULATIVE_TOKENS = 3  # k when neither the user, the draft's record nor its training says otherwise


DRAFT_KWARGS = ("vocab_size", "hidden_size", "aux_layer_ids")  # the draft kwargs every stage may read


@runtime_checkable
class DraftModel(Protocol):
    """What the stages rely on in a family's draft, an ``nn.Module`` that ``family.model(**draft.kwargs)`` rebuilds.

    * ``kwargs``: its keyword arguments, saved as ``draft_config.json``'s ``kwargs``; every family's have
      :data:`DRAFT_KWARGS`: ``vocab_size`` and ``hidden_size`` (checked against the verifier) and ``aux_layer_ids``
      (the verifier layers it reads; None when not recorded). ``hidden_size`` is the verifier's unless the kwargs
      also have ``target_hidden_size``.
    * ``after_load(device)``: called once weights were assigned into a meta-device build (rebuild non-persistent
      buffers such as RoPE's, re-freeze the weights it shares with the verifier).
    * ``d2t`` (optional, a buffer): ``(Vd,)`` draft id -> target id offset, in drafts with a vocabulary of their own;
      train checks an ``--init-from`` draft's against the run's vocabulary.
    """

    kwargs: dict[str, Any]

    def after_load(self, device: str | torch.device) -> None: ...


@dataclass(frozen=True)
class BuildInputs:
    """Everything about the verifier that a family needs to build a fresh draft for it."""

    verifier_config: Any  # the verifier's (text) HF config
    d2t: torch.Tensor  # (Vd,) int64 draft id -> target id offset
    t2d: torch.Tensor  # (V,) bool
    aux_layer_ids: list[int]
    embed_weight: torch.Tensor | None = None  # (V, H) the verifier's token embeddings
    lm_head_weight: torch.Tensor | None = None  # (V, H) the verifier's lm_head, when the draft starts from it
    verifier_path: str | None = None  # the verifier's name or folder, for families that read its files


def mask_token_of(requested: int | None, verifier_config: Any) -> int:
    """The token id a draft feeds at its mask slots: ``requested``, else the verifier's pad token, else its eos
    token (the first of a list), else 0."""
    if requested is not None:
        return requested
    for key in ("pad_token_id", "eos_token_id"):
        value = getattr(verifier_config, key, None)
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int):
            return value
    return 0


def resolve_layer_type(layer_type: str, verifier_config: Any) -> str:
    """A draft option ``layer_type``: ``auto`` is qwen3 for a Qwen3 verifier, else llama."""
    if layer_type != "auto":
        return layer_type
    return "qwen3" if str(getattr(verifier_config, "model_type", "")).startswith("qwen3") else "llama"


@dataclass
class StepOutput:
    loss: torch.Tensor  # scalar, differentiable
    metrics: dict[str, torch.Tensor]  # detached sums; they add up exactly across micro-batches and ranks


@runtime_checkable
class Objective(Protocol):
    """The training forward of a family: an ``nn.Module`` whose only registered submodule is the draft
    (DDP/FSDP wrap it), holding the frozen verifier head outside its parameter tree."""

    draft: DraftModel

    def forward(self, batch: dict[str, Any], loss_normalizer: torch.Tensor | None = None) -> StepOutput: ...

    def loss_counts(self, batch: dict[str, Any]) -> torch.Tensor:
        """Local counts of loss positions per loss group; summed over the whole optimizer step (all ranks and
        micro-batches) they are the ``loss_normalizer`` that makes the gradient exact."""
        ...

    def new_stats(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Zeroed metric sums with the shapes ``forward`` returns."""
        ...

    def summarize(self, stats: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Summed metrics -> what is logged. Always has ``loss`` and ``accept_len`` (expected acceptance length,
        used to pick ``best/``); ``acc`` (per-position accuracy list) when the family has positions."""
        ...


@runtime_checkable
class Proposer(Protocol):
    """A draft during speculative decoding. The evaluator feeds verified features with :meth:`commit` and asks
    for ``k`` tokens with :meth:`propose_chain`; ``draft_forwards`` counts draft forward passes."""

    draft_forwards: int
    supports_tree: bool

    def reset(self) -> None: ...

    def commit(self, tokens: list[int], aux: torch.Tensor, start: int) -> None:
        """Verified features: ``aux [T, n_aux*Ht]`` of positions ``start..start+T-1`` with ``tokens`` (the token
        at each position + 1). Drops any speculative draft state from ``start`` on."""
        ...

    def propose_chain(self, k: int, params: SamplingParams,
                      generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        """``k`` draft tokens (target ids) after the pending one; with sampling also their distributions."""
        ...

    # Families with ``supports_tree`` also have ``build_tree(root: int, params: TreeParams) -> DraftTree``.
    # Proposers that run beside a vision-language verifier also have ``set_positions(positions: Tensor [T])``:
    # the RoPE positions of the prompt's T slots (M-RoPE's temporal row; later slots continue from the last).
    # ``propose_chain`` may return fewer than ``k`` tokens (a proposer that cuts its chain short); the evaluator
    # verifies what it returns.


@runtime_checkable
class ConfidenceProposer(Protocol):
    """A proposer that predicts, per drafted token, the probability that the verifier accepts it (given the tokens
    before it were accepted), and can cut its chain where the running product of those drops below
    ``confidence_threshold`` (None: off, every drafted token is verified)."""

    has_confidence: bool  # False: the draft carries no confidence estimate (a threshold is refused)
    confidence_threshold: float | None
    last_confidences: list[float]  # after propose_chain: one per returned token


@dataclass(frozen=True)
class TreeParams:
    """EAGLE-2 dynamic tree: ``depth`` draft levels, ``topk`` children per expanded node and ``topk`` nodes
    expanded per level, ``total_tokens`` draft nodes (root excluded) sent to the verifier."""

    depth: int = 5
    topk: int = 4
    total_tokens: int = 24


@dataclass
class DraftTree:
    """A proposed tree for one verification: node 0 is the root (the pending token); parents before children."""

    tokens: list[int]
    parents: list[int]  # -1 for the root
    depths: list[int]


@dataclass(frozen=True)
class ExportInfo:
    """What an export format needs beyond the draft itself."""

    verifier_name: str
    verifier_architectures: list[str]
    speculative_tokens: int
    dtype: torch.dtype


@dataclass(frozen=True)
class DraftFormat:
    """An on-disk format of a family (``config.json`` + ``model.safetensors``), both directions.

    ``write(draft, info) -> (config, tensors)``; ``detect(config_json) -> bool``; ``read(directory, config_json,
    tensors) -> (kwargs, state, record)`` where ``record`` has ``verifier`` and optionally ``speculative_tokens``;
    ``recorded(directory, config_json) -> record``: what the config alone records, without the weights (``verifier``
    with its ``name_or_path``, and ``speculative_tokens`` when the config gives it);
    ``serve(verifier_name, folder, k) -> str`` is the command that serves it; ``card`` the model card's
    family-specific text (title, one paragraph, draft rows, library name).
    """

    name: str
    write: Callable[[DraftModel, ExportInfo], tuple[dict[str, Any], dict[str, torch.Tensor]]]
    detect: Callable[[Mapping[str, Any]], bool]
    read: Callable[[Path, Mapping[str, Any], dict[str, torch.Tensor]],
                   tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]]
    serve: Callable[[str, str, int], str]
    card: Callable[[Mapping[str, Any]], dict[str, Any]]
    vllm_speculative_config: Callable[[str, int], dict[str, Any]] | None = None  # None: vLLM cannot serve it
    companions: Callable[[str], list[Path]] | None = None  # (verifier_name) -> files export copies beside the weights
    recorded: Callable[[Path, Mapping[str, Any]], dict[str, Any]] = lambda directory, config: {"verifier": {}}


@dataclass(frozen=True)
class DraftFamily:
    name: str
    summary: str  # one line, for help texts and model cards
    model: type[nn.Module]  # model(**draft.kwargs) rebuilds the architecture
    options: type  # frozen dataclass of the family's training options (all fields have defaults)
    build: Callable[[BuildInputs, Any], DraftModel]
    default_aux_layer_ids: Callable[[int], list[int]]
    objective: Callable[..., nn.Module]  # (draft, target_head, options, attention) -> Objective
    proposer: Callable[[DraftModel], Proposer]
    formats: tuple[DraftFormat, ...]
    speculative_tokens: Callable[[Any], int]  # the default k to serve with, from the training options
    notes: dict[str, str] = field(default_factory=dict)
    fixed_aux_layer_ids: bool = False  # it always reads default_aux_layer_ids(N) (e.g. MTP: [N], the last state)
    reads_verifier_files: bool = False  # build reads weights from the verifier's own files (BuildInputs.verifier_path)
    uses_verifier_vocab: bool = False  # it predicts over the verifier's whole vocabulary: train needs no --vocab
    # drafts of other families this one starts from (train --init-from): family name -> (that draft, this run's
    # options) -> a draft of this family holding its weights
    warm_starts: Mapping[str, Callable[[DraftModel, Any], DraftModel]] = field(default_factory=dict)
    # options that fix the architecture (also keyword arguments of ``model``): a draft started from with
    # --init-from keeps its own shape, so a run that sets one of them to another value than the draft's is refused
    shape_options: tuple[str, ...] = ()
    # options that only act when a draft is built fresh (how its weights start): --init-from with one of them set
    # away from its default is refused, as the run would silently not do it
    fresh_options: tuple[str, ...] = ()

    def resolve_speculative_tokens(self, config: Mapping[str, Any], given: int | None = None,
                                   default: int = DEFAULT_SPECULATIVE_TOKENS) -> int:
        """k, the draft tokens per step: ``given``, else what the draft records (``config["speculative_tokens"]``,
        its format's or our checkpoint's), else what it was trained for (this family's ``speculative_tokens`` of the
        options in ``config["trained_with"]``), else ``default``."""
        trained = config.get("trained_with")
        return int(given or config.get("speculative_tokens")
                   or (self.speculative_tokens(options_from_record(self.options, trained)) if trained else 0)
                   or default)

    def format(self, name: str | None = None) -> DraftFormat:
        if name is None:
            return self.formats[0]
        for fmt in self.formats:
            if fmt.name == name:
                return fmt
        raise UserError(f"a {self.name} draft cannot be written as {name!r} "
                        f"(its formats: {', '.join(f.name for f in self.formats)})")
