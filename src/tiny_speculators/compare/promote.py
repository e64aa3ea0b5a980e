"""The ``promote`` stage: a new draft replaces the served one only when ``compare`` says it should.

``DEPLOY/current`` is what the serving fleet loads (``vllm serve ... --speculative-config '{"model":
"DEPLOY/current", ...}'``). It is a symbolic link into ``DEPLOY/releases/``, as is ``DEPLOY/previous`` (the draft
it replaced). A promotion copies the new draft into a release folder, points ``previous`` at what ``current``
pointed at, then points ``current`` at the new release; each pointer changes with one atomic rename, so a reader
sees the old draft or the new one, never half of one. Releases neither pointer names are removed.

The gate: with no current draft, the new one is installed. Otherwise both are decoded on the same prompts and
compared (paired bootstrap, ``compare``): ``require: better`` promotes when τ_new - τ_current is above ``margin``
at ``confidence``; ``not-worse`` when it is above ``-margin``. A draft equal to the current one (same files) is a
no-op. Either way ``OUT/summary.json`` says what happened and why, with the numbers.

    tiny-speculators promote --draft runs/nightly/export --deploy /srv/drafts/qwen3-8b --verifier Qwen/Qwen3-8B \
        --out runs/nightly/promote --require better --margin 0.02
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Literal

from tiny_speculators.atomic import write_json_atomic
from tiny_speculators.compare.stage import compare
from tiny_speculators.errors import UserError

__all__ = ["promote"]

log = logging.getLogger(__name__)


def promote(
    draft: Path,
    out: Path,
    deploy: Path,
    verifier: str | None = None,
    require: Literal["better", "not-worse"] = "better",
    margin: float = 0.0,
    confidence: float = 0.95,
    prompts: str = "builtin",
    max_prompts: int | None = None,
    max_new_tokens: int = 128,
    k: int | None = None,
    resamples: int = 10000,
    seed: int = 0,
    dtype: Literal["float32", "bfloat16", "float16"] = "float32",
    device: str = "cpu",
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Install ``draft`` as ``DEPLOY/current`` when it beats the current draft (or there is none).

    Args:
        draft: the new draft: an exported folder (what the serving fleet loads).
        out: output folder: summary.json (the decision, the reason, the numbers) and compare/.
        deploy: the folder that holds current and previous (links into releases/), created when missing.
        verifier: the verifier both drafts are decoded with.
        require: better: promote when τ_new - τ_current > margin at confidence; not-worse: when > -margin.
        margin: the τ difference that counts (see require).
        confidence: the confidence of the verdict (paired bootstrap over the prompts).
        prompts: the prompts both drafts are decoded on: a built-in set or a JSONL file.
        max_prompts: decode only the first N prompts.
        max_new_tokens: generation length per prompt.
        k: draft tokens per verification step (default: what each draft records).
        resamples: bootstrap draws.
        seed: seed of the bootstrap draws.
        dtype: dtype of the decoding.
        device: torch device of the decoding.
        trust_remote_code: allow the verifier's custom modelling code.
    """
    draft, out, deploy = Path(draft), Path(out), Path(deploy)
    if not (draft / "config.json").is_file():
        raise UserError(f"{draft} is not an exported draft (no config.json): promote what `export` wrote")
    out.mkdir(parents=True, exist_ok=True)
    current = _current(deploy)
    fingerprint = _fingerprint(draft)
    decision: dict[str, Any] = {"draft": str(draft), "deploy": str(deploy), "require": require, "margin": margin,
                                "confidence": confidence, "fingerprint": fingerprint}
    if current is None:
        decision.update(promoted=True, reason="there was no current draft")
    elif _fingerprint(current) == fingerprint:
        decision.update(promoted=False, reason="the draft is the current one already (same files)")
    else:
        if verifier is None:
            raise UserError("promote needs --verifier to decode the current and the new draft")
        # the current draft's decoding, kept in its release when it was promoted, serves again when nothing it
        # depends on changed (greedy decoding gives the same counts): only the new draft is decoded then
        settings = _evaluation_settings(verifier, prompts, max_prompts, max_new_tokens, k, dtype, device)
        reference = current / EVALUATION if _evaluated_with(current, settings) else current
        decision["current_evaluation"] = "reused" if reference != current else "decoded"
        result = compare([reference, draft], out / "compare", verifier=verifier, prompts=prompts, k=k,
                         max_new_tokens=max_new_tokens, max_prompts=max_prompts, dtype=dtype, device=device,
                         confidence=confidence, margin=margin, resamples=resamples, seed=seed,
                         trust_remote_code=trust_remote_code)
        (diff,) = result["differences"]
        passed = diff["better"] if require == "better" else diff["not_worse"]
        numbers = (f"τ {result['drafts'][1]['tau']:.3f} against {result['drafts'][0]['tau']:.3f}, difference "
                   f"{diff['tau_difference']:+.3f}, one-sided {confidence:.0%} bound {diff['lower_bound']:+.3f}, "
                   f"{result['prompts']} prompts")
        word = "better" if require == "better" else "not worse"
        decision.update(promoted=passed, tau_current=result["drafts"][0]["tau"], tau_new=result["drafts"][1]["tau"],
                        difference=diff, reason=(f"{word} than the current draft" if passed
                                                 else f"not {word} than the current draft (margin {margin})")
                        + f": {numbers}")
    if decision["promoted"]:
        validated = ({"acceptance_length": decision["tau_new"], "k": k, "num_prompts": result["prompts"],
                      "prompts": prompts, "verifier_id": result["verifier_id"]} if "tau_new" in decision else None)
        decision["previous"] = str(current.resolve()) if current is not None else None  # before the swap
        evaluation = None
        if "tau_new" in decision:
            evaluation = (out / "compare" / "drafts" / _folder_name(result["names"][1]) / "results.json", settings)
        decision["release"] = str(_install(draft, deploy, fingerprint, validated, evaluation))
    log.info("promote: %s %s (%s)", draft, "promoted" if decision["promoted"] else "not promoted", decision["reason"])
    write_json_atomic(out / "summary.json", decision)
    return decision


EVALUATION = "evaluation"  # in a release: the decoding promote validated it with (results.json, settings.json)


def _evaluation_settings(verifier: str, prompts: str, max_prompts: int | None, max_new_tokens: int, k: int | None,
                         dtype: str, device: str) -> dict[str, Any]:
    """What a decoding's per-prompt counts depend on: another decoding with the same settings counts the same."""
    from tiny_speculators import __version__
    from tiny_speculators.verifier.fingerprint import verifier_fingerprint

    prompt_file = Path(prompts)
    return {"verifier": verifier_fingerprint(verifier), "prompts": prompts,
            "prompts_sha256": hashlib.sha256(prompt_file.read_bytes()).hexdigest() if prompt_file.is_file() else None,
            "max_prompts": max_prompts, "max_new_tokens": max_new_tokens, "k": k, "dtype": dtype,
            "device": device, "tiny_speculators": __version__}


def _evaluated_with(current: Path, settings: dict[str, Any]) -> bool:
    path = current / EVALUATION / "settings.json"
    try:
        return path.is_file() and (current / EVALUATION / "results.json").is_file() and \
            json.loads(path.read_text(encoding="utf-8")) == settings
    except (OSError, json.JSONDecodeError):
        return False


def _folder_name(name: str) -> str:
    return name.replace("/", "-").replace(":", "-")  # how compare names the folder of a draft it decoded


def _current(deploy: Path) -> Path | None:
    """``DEPLOY/current`` when it holds a draft; a plain folder left by hand becomes a release first."""
    current = deploy / "current"
    if current.is_symlink() and not current.exists():
        raise UserError(f"{current} points at {os.readlink(current)}, which does not exist: repoint or remove it")
    if not current.exists():
        return None
    if not current.is_symlink():  # a folder put there by hand: keep it as a release and point at it
        release = deploy / "releases" / f"{time.strftime('%Y%m%dT%H%M%S')}-initial"
        release.parent.mkdir(parents=True, exist_ok=True)
        current.rename(release)
        _point(deploy / "current", release)
    return deploy / "current"


def _fingerprint(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(q for q in folder.rglob("*") if q.is_file()):
        if p.name == "summary.json" or p.relative_to(folder).parts[0] == EVALUATION:  # records, not the draft
            continue
        h.update(str(p.relative_to(folder)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def _install(draft: Path, deploy: Path, fingerprint: str, validated: dict[str, Any] | None,
             evaluation: tuple[Path, dict[str, Any]] | None) -> Path:
    """Copy ``draft`` into a new release (recording the τ it was validated at, when promote measured it) and point
    ``current`` at it, ``previous`` at the release it replaces."""
    releases = deploy / "releases"
    releases.mkdir(parents=True, exist_ok=True)
    release = releases / f"{time.strftime('%Y%m%dT%H%M%S')}-{fingerprint}"
    partial = releases / f".{release.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(draft, partial)
    if validated is not None:
        record = partial / "summary.json"
        summary = json.loads(record.read_text(encoding="utf-8")) if record.is_file() else {}
        write_json_atomic(record, {**summary, "validated": validated})
    if evaluation is not None and evaluation[0].is_file():
        (partial / EVALUATION).mkdir(exist_ok=True)
        shutil.copy2(evaluation[0], partial / EVALUATION / "results.json")
        write_json_atomic(partial / EVALUATION / "settings.json", evaluation[1])
    partial.rename(release)
    current = deploy / "current"
    if current.is_symlink():
        _point(deploy / "previous", current.resolve())
    _point(current, release)
    keep = {(deploy / name).resolve() for name in ("current", "previous") if (deploy / name).is_symlink()}
    for old in releases.iterdir():
        if old.resolve() not in keep and not old.name.startswith("."):
            shutil.rmtree(old)
    return release


def _point(link: Path, target: Path) -> None:
    """Make ``link`` a symbolic link to ``target`` (relative, so the deploy folder can move) in one rename."""
    tmp = link.parent / f".{link.name}.new"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(os.path.relpath(target, link.parent))
    os.replace(tmp, link)
