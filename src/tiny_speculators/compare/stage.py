"""The ``compare`` stage: two or more drafts decoded on the same prompts, τ with paired bootstrap intervals.

Each draft is either an ``evaluate`` output folder (its ``results.json`` is read) or a draft folder, which is run
through ``evaluate`` here (into ``OUT/drafts/``) on the given prompts. The first draft is A, the reference; every
other one is compared with it, overall, per draft position and per prompt category (a prompt's id up to its last
"-": ``chat-03`` is chat). ``--backend vllm`` measures each exported draft in ``vllm serve`` instead, from the
counters vLLM keeps while it serves the same prompts (:mod:`.served`). With ``--require better`` (or
``not-worse``) the exit code is the verdict: 0 when every other draft passes against A at ``--confidence`` (beyond
``--margin``), 3 when one does not, 1 on bad input.

    tiny-speculators compare --drafts runs/old/export runs/new/export --verifier smollm2-135m --out runs/compare \
        --max-prompts 12 --require better
    tiny-speculators compare --drafts deploy/current runs/new/export --out runs/compare-vllm --backend vllm \
        --max-prompts 12 --require not-worse --margin 0.05
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

from tiny_speculators.atomic import atomic_write, write_json_atomic
from tiny_speculators.compare.stats import Counts, paired_bootstrap
from tiny_speculators.errors import UserError
from tiny_speculators.tables import print_summary_table

__all__ = ["GateNotPassed", "compare"]

log = logging.getLogger(__name__)


class GateNotPassed(UserError):
    """``--require`` was not met: the run's numbers are written, and the command exits with 3."""

    exit_code = 3


def compare(
    drafts: list[Path],
    out: Path,
    verifier: str | None = None,
    prompts: str = "builtin",
    k: int | None = None,
    max_new_tokens: int = 128,
    max_prompts: int | None = None,
    dtype: Literal["float32", "bfloat16", "float16"] = "float32",
    device: str = "cpu",
    confidence: float = 0.95,
    margin: float = 0.0,
    resamples: int = 10000,
    seed: int = 0,
    require: Literal["none", "better", "not-worse"] = "none",
    trust_remote_code: bool = False,
    backend: Literal["evaluate", "vllm"] = "evaluate",
    endpoints: list[str] | None = None,
    vllm_venv: Path | None = None,
) -> dict[str, Any]:
    """Compare drafts on the same prompts: τ per draft and τ_B - τ_A with paired bootstrap intervals.

    Args:
        drafts: two or more: evaluate output folders (results.json) or draft folders (exported, checkpoints or train
            outputs) to evaluate here; the first is the reference A.
        out: output folder: compare.json, summary.json, compare.png, and drafts/ with the evaluations run here.
        verifier: the verifier, for drafts that are evaluated here (not needed for evaluate output folders).
        prompts: the prompts drafts are evaluated on here: built-in sets (builtin, user, chat, code, math;
            comma-joined) or a JSONL file.
        k: draft tokens per verification step for drafts evaluated here (default: what each draft records).
        max_new_tokens: generation length per prompt for drafts evaluated here.
        max_prompts: evaluate only the first N prompts.
        dtype: dtype for drafts evaluated here.
        device: torch device for drafts evaluated here.
        confidence: the confidence of the intervals and of the verdicts (0.95: 95%).
        margin: the τ difference that counts: better means τ_B - τ_A > margin, not-worse means > -margin (at
            confidence).
        resamples: bootstrap draws over the prompts.
        seed: seed of the bootstrap draws.
        require: none, or the verdict every other draft must reach against A for the command to exit 0 (else 3).
        trust_remote_code: allow the verifier's custom modelling code (drafts evaluated here).
        backend: evaluate (our evaluator decodes each draft) or vllm (vLLM serves each exported draft, and its
            /metrics counters are read prompt by prompt: the acceptance the fleet will see).
        endpoints: backend vllm: running servers, one per draft in the same order, each serving that draft (they
            must take no other requests while compare measures); default: start vllm serve for each draft in turn.
        vllm_venv: backend vllm: the vLLM environment the servers start from (default: $TINY_SPECULATORS_VLLM_VENV
            or ~/.cache/tiny-speculators/vllm-venv, as scripts/vllm_env.sh builds it).
    """
    drafts = [Path(d) for d in drafts]
    _check_arguments(drafts, confidence, margin, resamples)
    if endpoints is not None and (backend != "vllm" or len(endpoints) != len(drafts)):
        raise UserError(f"--endpoints: one running vLLM server per draft ({len(drafts)}), with --backend vllm")
    out = Path(out)
    names = _names(drafts)
    options = dict(prompts=prompts, k=k, max_new_tokens=max_new_tokens, max_prompts=max_prompts, dtype=dtype)
    if backend == "vllm":
        served_by = endpoints or [None] * len(drafts)
        results = [_served(d, name, out, verifier, endpoint=url, vllm_venv=vllm_venv, **options)
                   for d, name, url in zip(drafts, names, served_by, strict=True)]
    else:
        results = [_results(d, name, out, verifier, device=device, trust_remote_code=trust_remote_code, **options)
                   for d, name in zip(drafts, names, strict=True)]
    ids = _paired_prompts(results, drafts)
    counts = [_counts(r) for r in results]
    overall = paired_bootstrap(counts, resamples=resamples, seed=seed, confidence=confidence, margin=margin)
    categories = {}
    for category in sorted({_category(i) for i in ids}):
        keep = [j for j, i in enumerate(ids) if _category(i) == category]
        categories[category] = paired_bootstrap([_subset(c, keep) for c in counts], resamples=resamples, seed=seed,
                                                confidence=confidence, margin=margin)
    summary = {
        "drafts": [str(d) for d in drafts], "names": names, "reference": names[0], "prompts": len(ids),
        "verifier_id": results[0].get("verifier_id"), "k": [r.get("k") for r in results],
        "confidence": confidence, "margin": margin, "resamples": resamples, "seed": seed, "require": require,
        "backend": backend,
        **{key: overall[key] for key in ("drafts", "differences")},
        "per_category": {c: {key: v[key] for key in ("prompts", "drafts", "differences")}
                         for c, v in categories.items()},
    }
    summary["passed"] = _verdict(summary["differences"], require)
    _write_outputs(out, summary, names)
    _print(summary, names)
    if summary["passed"] is False:
        failing = [names[i + 1] for i, d in enumerate(summary["differences"])
                   if not d["better" if require == "better" else "not_worse"]]
        verdict = f"better than {names[0]}" if require == "better" else f"at worst the margin below {names[0]}"
        raise GateNotPassed(f"{', '.join(failing)} not {verdict} at {confidence:.0%} confidence "
                            f"(margin {margin}): see {out / 'compare.json'}")
    return summary


def _check_arguments(drafts: list[Path], confidence: float, margin: float, resamples: int) -> None:
    if len(drafts) < 2:
        raise UserError("compare needs at least two drafts (the first is the reference)")
    if not 0.5 <= confidence < 1:
        raise UserError(f"confidence must be in [0.5, 1), not {confidence}")
    if margin < 0:
        raise UserError(f"margin must be 0 or more, not {margin}")
    if resamples < 100:
        raise UserError(f"resamples must be at least 100, not {resamples}")


def _names(drafts: list[Path]) -> list[str]:
    """Short labels: the folder name, with its parent's when two are alike (runs/a/export, runs/b/export)."""
    names = [d.name for d in drafts]
    if len(set(names)) < len(names):
        names = [f"{d.parent.name}/{d.name}" for d in drafts]
    if len(set(names)) < len(names):  # the same folder twice
        names = [f"{i}:{d.name}" for i, d in enumerate(drafts)]
    return names


def _results(draft: Path, name: str, out: Path, verifier: str | None, **options: Any) -> dict[str, Any]:
    """The per-prompt results of ``draft``: read from an evaluate output folder, or evaluated here."""
    if (draft / "results.json").is_file():
        try:
            results = json.loads((draft / "results.json").read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise UserError(f"{draft / 'results.json'} is not valid JSON ({e.msg})") from None
        if not isinstance(results, dict) or not isinstance(results.get("per_prompt"), list):
            raise UserError(f"{draft / 'results.json'} is not an evaluate result (no per_prompt list)")
        return results
    if not draft.exists():
        raise UserError(f"draft {draft} does not exist")
    if verifier is None:
        raise UserError(f"{draft} is a draft, not an evaluate output: --verifier is needed to evaluate it")
    from tiny_speculators.evaluate.stage import evaluate

    target = out / "drafts" / name.replace("/", "-").replace(":", "-")
    log.info("evaluating %s into %s", draft, target)
    evaluate(verifier, draft, target, baseline=False, **options)
    return json.loads((target / "results.json").read_text(encoding="utf-8"))


def _served(draft: Path, name: str, out: Path, verifier: str | None, **options: Any) -> dict[str, Any]:
    """The per-prompt counters of ``draft`` as vLLM serves it, kept in ``OUT/drafts/NAME/results.json``."""
    from tiny_speculators.compare.served import served_results

    if not draft.exists():
        raise UserError(f"draft {draft} does not exist")
    results = served_results(draft, name, out, verifier, **options)
    write_json_atomic(out / "drafts" / name.replace("/", "-").replace(":", "-") / "results.json", results)
    return results


def _paired_prompts(results: list[dict[str, Any]], drafts: list[Path]) -> list[str]:
    ids = [str(p["id"]) for p in results[0]["per_prompt"]]
    if not ids:
        raise UserError(f"{drafts[0]} holds no prompts")
    for r, d in zip(results[1:], drafts[1:], strict=True):
        other = [str(p["id"]) for p in r["per_prompt"]]
        if other != ids:
            raise UserError(f"{d} was evaluated on other prompts than {drafts[0]} ({len(other)} vs {len(ids)}, "
                            "or in another order): a paired comparison needs the same prompts")
    verifiers = {r.get("verifier_id") for r in results}
    if len(verifiers) > 1:
        raise UserError(f"the drafts were evaluated against different verifiers: {sorted(map(str, verifiers))}")
    return ids


def _counts(results: dict[str, Any]) -> Counts:
    rows = results["per_prompt"]
    return Counts(drafts=[int(p["num_drafts"]) for p in rows], accepted=[int(p["num_accepted_tokens"]) for p in rows],
                  per_position=[[int(x) for x in p["num_accepted_tokens_per_pos"]] for p in rows])


def _subset(c: Counts, keep: list[int]) -> Counts:
    return Counts([c.drafts[j] for j in keep], [c.accepted[j] for j in keep], [c.per_position[j] for j in keep])


def _category(prompt_id: str) -> str:
    return prompt_id.rsplit("-", 1)[0] if "-" in prompt_id else "all"


def _verdict(differences: list[dict[str, Any]], require: str) -> bool | None:
    if require == "none":
        return None
    key = "better" if require == "better" else "not_worse"
    return all(d[key] for d in differences)


def _write_outputs(out: Path, summary: dict[str, Any], names: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "compare.json", summary)
    write_json_atomic(out / "summary.json", {k: v for k, v in summary.items() if k != "per_category"})
    _plot(out / "compare.png", summary, names)


def _print(summary: dict[str, Any], names: list[str]) -> None:
    conf = f"{summary['confidence']:.0%}"
    rows = [(names[0] + " (A)", f"{summary['drafts'][0]['tau']:.3f}",
             "{:.3f}-{:.3f}".format(*summary["drafts"][0]["tau_interval"]), "", "")]
    for name, d, diff in zip(names[1:], summary["drafts"][1:], summary["differences"], strict=True):
        rows.append((name, f"{d['tau']:.3f}", "{:.3f}-{:.3f}".format(*d["tau_interval"]),
                     "{:+.3f} ({:+.3f} to {:+.3f})".format(diff["tau_difference"], *diff["interval"]),
                     "better" if diff["better"] else "not worse" if diff["not_worse"] else "worse or unclear"))
    print_summary_table(f"compare on {summary['prompts']} prompts ({conf} intervals, paired bootstrap)", rows,
                        header=("draft", "τ", f"τ {conf}", "τ - τ_A", "verdict"), stderr=False)


def _plot(path: Path, summary: dict[str, Any], names: list[str]) -> None:
    """PNG: τ per draft with its interval (left), per-position acceptance per draft (middle), τ per draft and
    prompt category (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    taus = [d["tau"] for d in summary["drafts"]]
    errs = [[t - d["tau_interval"][0] for t, d in zip(taus, summary["drafts"], strict=True)],
            [d["tau_interval"][1] - t for t, d in zip(taus, summary["drafts"], strict=True)]]
    ax1.bar(range(len(names)), taus, yerr=errs, capsize=4, color="tab:blue")
    ax1.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    ax1.set_xticks(range(len(names)))
    ax1.set_xticklabels(names, rotation=20, fontsize=8)
    ax1.set_ylabel("τ (tokens per verifier forward)")
    ax1.set_title(f"τ, {summary['confidence']:.0%} interval")
    for name, d in zip(names, summary["drafts"], strict=True):
        xs = list(range(1, len(d["per_position_acceptance"]) + 1))
        ax2.plot(xs, d["per_position_acceptance"], marker="o", label=name)
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("acceptance rate")
    ax2.set_ylim(0, 1)
    ax2.set_title("per-position acceptance")
    ax2.legend(fontsize=7)
    cats = list(summary["per_category"])
    width = 0.8 / len(names)
    for m, name in enumerate(names):
        ax3.bar([c + m * width for c in range(len(cats))],
                [summary["per_category"][c]["drafts"][m]["tau"] for c in cats], width=width, label=name)
    ax3.set_xticks([c + 0.4 - width / 2 for c in range(len(cats))])
    ax3.set_xticklabels(cats, fontsize=8)
    ax3.set_title("τ per prompt category")
    ax3.legend(fontsize=7)
    fig.suptitle(f"{len(names)} drafts on the same {summary['prompts']} prompts")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
