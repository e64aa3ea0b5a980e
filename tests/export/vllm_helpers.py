"""A quickly trained EAGLE-3 draft of the embedded SmolLM2 verifier, for the vLLM acceptance comparison.

Self-distillation: the verifier's own greedy answers to ``TRAIN_PROMPTS`` (fp32, HF), its aux hidden
states on them, and ~100 TTT steps (``models/ttt.py``) with lm_head initialized from the
verifier's rows. Takes ~1 minute on 2 idle CPU cores; the draft reaches an acceptance length
around 2 on unseen ``EVAL_PROMPTS`` (k=3), enough for the per-position rates to mean something.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from shared_cache import key as cache_key
from shared_cache import shared, shared_json

log = logging.getLogger(__name__)

TRAIN_PROMPTS = [
    "What are three tips for staying focused while working from home?",
    "Explain the difference between weather and climate in two sentences.",
    "Write a short, friendly message declining an invitation to a party.",
    "Why do cats purr?",
    "Suggest a name for a small bakery that sells sourdough bread.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Give me a simple recipe for pancakes.",
    "How do plants make their food?",
    "Write a Python function that returns the factorial of n.",
    "What does the 'git rebase' command do?",
    "Explain what a linked list is to a beginner.",
    "Write a haiku about the ocean.",
    "List four benefits of regular exercise.",
    "How can I improve my sleep quality?",
    "What is the difference between a virus and a bacterium?",
    "Write a short story opening about a lighthouse keeper.",
    "Explain recursion with a simple example.",
    "What should I pack for a weekend camping trip?",
    "Describe the water cycle.",
    "How do I center a div in CSS?",
    "What is photosynthesis?",
    "Give three ideas for a rainy day activity with kids.",
    "What is the Pythagorean theorem?",
    "Write a polite email asking for a deadline extension.",
]
EVAL_PROMPTS = [
    "What are some good habits for learning a new language?",
    "Explain how a bicycle stays upright.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Give me three tips for a job interview.",
    "What is the difference between a list and a tuple in Python?",
]
AUX_LAYER_IDS = [2, 15, 27]
SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
CHECK = Path(__file__).with_name("vllm_check.py")


class VllmWorker:
    """``vllm_check.py worker`` in the vLLM environment, one per test session: vLLM imported once, the engines of
    all jobs built in that process, one after the other. Plain (``--no-spec``) runs are greedy and deterministic, so
    each is done once per test run (``shared_cache``, across xdist workers) and its result copied for later askers.
    Started on first use, stopped (also on error) by :meth:`close`; a failed job ends it, and the next job starts a
    fresh one. vLLM's log: ``log_path``."""

    def __init__(self, venv: Path, log_path: Path) -> None:
        self.python, self.log_path = venv / "bin" / "python", log_path
        self.process: subprocess.Popen | None = None
        self._plain: dict[tuple, Path] = {}

    def _start(self) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # tests/conftest.py says why
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   DO_NOT_TRACK="1", VLLM_LOGGING_LEVEL="WARNING", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        with self.log_path.open("a") as log:
            log.write(f"$ {self.python} {CHECK} worker\n")
            log.flush()
            return subprocess.Popen([str(self.python), str(CHECK), "worker"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=str(CHECK.parent),
                                    start_new_session=True)

    def run(self, *args: str, timeout: float = 1500) -> None:
        """``vllm_check.py ARGS`` in the worker; a failure fails the calling test with the error and the log's tail."""
        if self.process is None or self.process.poll() is not None:
            self.process = self._start()
        proc = self.process
        reply: list[str] = []
        proc.stdin.write(json.dumps(list(args)) + "\n")
        proc.stdin.flush()
        reader = threading.Thread(target=lambda: reply.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        answer = json.loads(reply[0]) if reply and reply[0] else {"ok": False, "error": "no reply (worker gone)"}
        if reader.is_alive():
            answer = {"ok": False, "error": f"no reply within {timeout:.0f} s"}
        if not answer["ok"]:
            self.close()
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:])
            pytest.fail(f"vLLM failed running {' '.join(args[:2])}: {answer['error']}\nlog {self.log_path}:\n{tail}")

    def plain(self, model: Path, out: Path, prompts: list[list[int]], max_tokens: int,
              max_model_len: int = 1024, dtype: str = "float32") -> dict:
        """vLLM's greedy generation without a draft (``--no-spec``), computed once per test run for each input."""
        key = (str(model), json.dumps(prompts), max_tokens, max_model_len, dtype)
        if key not in self._plain:
            def build(folder: Path) -> None:
                prompts_file = folder / "prompts.json"
                prompts_file.write_text(json.dumps(prompts))
                self.run("generate", str(model), str(folder / "plain.json"), "--prompts", str(prompts_file),
                         "--max-tokens", str(max_tokens), "--max-model-len", str(max_model_len), "--dtype", dtype,
                         "--no-spec")

            shutil.copy(shared(f"vllm-plain-{cache_key(*key)}", build) / "plain.json", out)  # once per test run
            self._plain[key] = out
        return json.loads(self._plain[key].read_text())

    def close(self) -> None:
        """End the worker: stdin closed (it returns), then SIGKILL to its process group if it does not."""
        proc, self.process = self.process, None
        if proc is None:
            return
        try:
            proc.stdin.close()
            proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def render(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


_HF_GREEDY: dict[tuple, list[int]] = {}  # (verifier, prompt, new tokens) -> HF greedy tokens


def our_acceptance(proposer, aux_layer_ids: list[int], verifier_dir: Path, tokenizer, k: int,
                   new_tokens: int) -> dict:
    """Our evaluator with ``proposer`` on ``EVAL_PROMPTS`` (greedy, HF verifier in fp32): acceptance counters, draft
    forwards, and the speculative and plain greedy tokens (the plain ones computed once per test run)."""
    from transformers import AutoModelForCausalLM

    from tiny_speculators.evaluate.decoding import autoregressive_generate, speculative_generate
    from tiny_speculators.evaluate.target import TargetRunner

    model = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval().requires_grad_(False)
    target = TargetRunner(model, aux_layer_ids)
    prompts = [render(tokenizer, p) for p in EVAL_PROMPTS]
    accepted, drafts, per_pos, spec_tokens, hf_tokens, forwards = 0, 0, [0] * k, [], [], 0
    for prompt in prompts:
        result = speculative_generate(target, proposer, prompt, k=k, max_new_tokens=new_tokens)
        spec_tokens.append(result.tokens)
        drafts += len(result.accepted)
        accepted += sum(result.accepted)
        forwards += result.draft_forwards
        for n in result.accepted:
            for i in range(n):
                per_pos[i] += 1
        key = (str(verifier_dir), tuple(prompt), new_tokens)  # plain greedy: once per test run for each input
        if key not in _HF_GREEDY:
            _HF_GREEDY[key] = shared_json(f"hf-greedy-{cache_key(*key)}", lambda p=prompt: autoregressive_generate(
                target, p, max_new_tokens=new_tokens).tokens)
        hf_tokens.append(_HF_GREEDY[key])
    target.close()
    return {"prompts": prompts, "drafts": drafts, "accepted": accepted, "per_position": per_pos,
            "acceptance_length": 1 + accepted / drafts, "draft_forwards": forwards, "spec_tokens": spec_tokens,
            "hf_tokens": hf_tokens}


def vllm_spec_and_plain(worker: VllmWorker, exported: Path, verifier_dir: Path, prompts: list[list[int]], root: Path,
                        new_tokens: int) -> dict:
    """vLLM's reading of the exported config, and its greedy generations with the draft and without it (the plain
    one shared by every draft of ``verifier_dir`` in the session)."""
    prompts_file = root / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    worker.run("config", str(exported), str(root / "config.json"))
    worker.run("generate", str(exported), str(root / "spec.json"), "--prompts", str(prompts_file),
               "--max-tokens", str(new_tokens))
    runs = {name: json.loads((root / f"{name}.json").read_text()) for name in ("config", "spec")}
    return {**runs, "plain": worker.plain(verifier_dir, root / "plain.json", prompts, new_tokens)}


def counters(run: dict) -> tuple[int, int, list[int]]:
    """vLLM's drafts, accepted tokens and accepted tokens per position in a ``generate`` run."""
    c = run["spec_decode"]
    return (c["vllm:spec_decode_num_drafts"], c["vllm:spec_decode_num_accepted_tokens"],
            list(c["vllm:spec_decode_num_accepted_tokens_per_pos"]))


def acceptance_report(spec: dict, plain: dict, ours: dict) -> dict:
    """vLLM's and our evaluator's acceptance side by side, and whether each engine's greedy output is lossless."""
    drafts, accepted, per_pos = counters(spec)
    return {
        "vllm": {"drafts": drafts, "accepted": accepted, "per_position": per_pos,
                 "acceptance_length": 1 + accepted / drafts, "generate_seconds": spec["generate_seconds"]},
        "ours": {"drafts": ours["drafts"], "accepted": ours["accepted"], "per_position": ours["per_position"],
                 "acceptance_length": 1 + ours["accepted"] / ours["drafts"],
                 "draft_forwards_per_step": ours["draft_forwards"] / ours["drafts"]},
        "vllm_spec_equals_vllm_plain": spec["tokens"] == plain["tokens"],
        "our_spec_equals_hf": [a == b for a, b in zip(ours["spec_tokens"], ours["hf_tokens"], strict=True)],
    }


def write_report(report: dict, env: str, default: Path) -> None:
    """The report as JSON into ``$env`` (default ``default``), and on stderr."""
    out = Path(os.environ.get(env, default))
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2), file=sys.stderr)


@torch.no_grad()
def greedy_answers(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> list[list[int]]:
    """The verifier's greedy continuations, all prompts in one left-padded batch (training data only)."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    generated = model.generate(ids, attention_mask=attn, max_new_tokens=new_tokens, do_sample=False,
                               pad_token_id=pad_id)
    return [row[width:].tolist() for row in generated]


def train_draft(verifier_dir: Path, out: Path, *, steps: int = 60, new_tokens: int = 48, seed: int = 0,
                algorithm: str = "eagle3", options: dict | None = None, verifier_name: str | None = None,
                lr: float = 2e-3, aux_layer_ids: list[int] | None = None, draft_vocab: bool = True) -> Path:
    """Train a small draft for ``verifier_dir`` and save it with ``save_draft`` into ``out`` (recording
    ``verifier_name``, default the embedded verifier's hub id). A family with ``fixed_aux_layer_ids`` reads its own
    layers; the others ``aux_layer_ids`` (default ``AUX_LAYER_IDS``). ``draft_vocab=False`` keeps the verifier's
    full vocabulary (identity maps) instead of the data's tokens.

    Runs on torch's default threads: the vLLM tests run last and one at a time, so nothing else loads the cores
    then (one thread was 1.6x slower on an idle 2-core machine; two threads thrash only when other jobs run).
    """
    args = dict(steps=steps, new_tokens=new_tokens, seed=seed, algorithm=algorithm, options=options or {},
                verifier_name=verifier_name or SMOLLM2_ID, lr=lr, aux_layer_ids=list(aux_layer_ids or AUX_LAYER_IDS),
                small_vocab=draft_vocab)
    # once per test run (shared_cache): the benchmark's and the export tests' modules ask for the same draft
    trained = shared(f"draft-{cache_key(str(verifier_dir), args)}",
                     lambda folder: _train_draft(verifier_dir, folder / "ckpt", **args))
    shutil.copytree(trained / "ckpt", out)
    return out


_DISTILLATION: dict[tuple, tuple[torch.Tensor, ...]] = {}  # (verifier, new_tokens[, aux ids]) -> tensors


@torch.no_grad()
def distillation_data(model, parts, tokenizer, verifier_dir: Path, new_tokens: int,
                      aux_ids: list[int]) -> tuple[torch.Tensor, ...]:
    """Self-distillation data on ``TRAIN_PROMPTS``: ``(ids, mask, attn, aux, last)``, the prompts followed by the
    verifier's greedy answers (right-padded; mask = the answers), and its hidden states at ``aux_ids``. Computed once
    per session for each verifier (answers) and layer set (states), and shared by every draft trained on them."""
    from tiny_speculators.verifier.capture import capture_hidden_states

    key = (str(verifier_dir), new_tokens)
    if key not in _DISTILLATION:
        _DISTILLATION[key] = _shared_tensors(f"answers-{cache_key(*key)}", lambda: _answers(
            model, tokenizer, new_tokens))
    ids, mask, attn = _DISTILLATION[key]
    states = (*key, tuple(aux_ids))
    if states not in _DISTILLATION:
        _DISTILLATION[states] = _shared_tensors(f"states-{cache_key(*states)}", lambda: capture_hidden_states(
            model, ids, attn, aux_ids, parts=parts))
    return (ids, mask, attn, *_DISTILLATION[states])


def _shared_tensors(name: str, compute) -> tuple[torch.Tensor, ...]:
    """``compute()``'s tensors, computed once per test run (``shared_cache``)."""
    folder = shared(name, lambda tmp: torch.save(tuple(compute()), tmp / "tensors.pt"))
    return tuple(torch.load(folder / "tensors.pt", weights_only=True))


def _answers(model, tokenizer, new_tokens: int) -> tuple[torch.Tensor, ...]:
    """``(ids, mask, attn)``: ``TRAIN_PROMPTS`` and the verifier's greedy answers (right-padded; mask = answers)."""
    log.info("generating training answers")
    prompts = [render(tokenizer, p) for p in TRAIN_PROMPTS]
    answers = greedy_answers(model, prompts, new_tokens, tokenizer.pad_token_id or 0)
    seqs = [p + a for p, a in zip(prompts, answers, strict=True)]
    length = max(map(len, seqs))
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    mask = torch.zeros(len(seqs), length, dtype=torch.long)
    attn = torch.zeros(len(seqs), length, dtype=torch.long)
    for i, (p, s) in enumerate(zip(prompts, seqs, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        mask[i, len(p): len(s)] = 1  # learn the answers
    return ids, mask, attn


def _train_draft(verifier_dir: Path, out: Path, *, steps: int, new_tokens: int, seed: int, algorithm: str,
                 options: dict, verifier_name: str, lr: float, aux_layer_ids: list[int], small_vocab: bool) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiny_speculators.models.checkpoint import save_draft
    from tiny_speculators.models.eagle3.family import build_draft, draft_kwargs_from_verifier
    from tiny_speculators.models.ttt import ttt_step
    from tiny_speculators.verifier.modules import find_parts

    tokenizer = AutoTokenizer.from_pretrained(verifier_dir)
    model = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval().requires_grad_(False)
    parts = find_parts(model)
    aux_ids = aux_layer_ids
    if algorithm != "eagle3":
        from tiny_speculators.models import get_family

        family = get_family(algorithm)
        if family.fixed_aux_layer_ids:
            aux_ids = family.default_aux_layer_ids(parts.num_hidden_layers)
    ids, mask, attn, aux, last = distillation_data(model, parts, tokenizer, verifier_dir, new_tokens, aux_ids)
    torch.manual_seed(seed)  # the draft's init does not depend on whether the data came from the cache

    # Draft vocab: every token of the data plus the most common low ids, sorted (d2t/t2d contract).
    vocab = model.config.vocab_size
    used = torch.unique(torch.cat([ids[attn.bool()], torch.arange(2048)])) if small_vocab else torch.arange(vocab)
    draft_vocab = int(used.numel())
    d2t = used - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    if algorithm != "eagle3":  # any other family through the family seam (its builder and objective)
        return _train_family(model, parts, out, algorithm, options, ids, mask, aux, last, d2t, t2d, steps, seed,
                             aux_ids=aux_ids, verifier_dir=verifier_dir, verifier_name=verifier_name, lr=lr)
    kwargs = {**draft_kwargs_from_verifier(model.config, draft_vocab), **options}  # e.g. fc_norm
    draft = build_draft(kwargs, d2t, t2d, embed_weight=parts.embed_tokens.weight.detach(),
                        lm_head_weight=parts.lm_head.weight.detach())

    def target_head(h: torch.Tensor) -> torch.Tensor:
        return parts.lm_head(parts.norm(h))

    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=2e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        rows = torch.randperm(len(ids), generator=generator)[:8]
        result = ttt_step(draft, input_ids=ids[rows], aux_hidden_states=aux[rows], loss_mask=mask[rows],
                          last_hidden_state=last[rows], target_head=target_head, steps=3, decay=0.8)
        optimizer.zero_grad(set_to_none=True)
        result.loss.backward()
        optimizer.step()
        if step % 25 == 0 or step == steps - 1:
            log.info("draft training step %d loss %.3f", step, float(result.loss.detach()))
    meta = {"aux_layer_ids": aux_ids,
            "verifier": {"name_or_path": verifier_name,
                         "architectures": list(model.config.architectures or []),
                         "hidden_size": model.config.hidden_size, "vocab_size": vocab},
            "trained_with": {"ttt_steps": 3, "decay": 0.8, "mode": "test self-distillation", "steps": steps}}
    save_draft(out, draft.eval(), meta)
    return out


def _train_family(model, parts, out: Path, algorithm: str, options: dict, ids, mask, aux, last, d2t, t2d,
                  steps: int, seed: int, *, aux_ids: list[int], verifier_dir: Path, verifier_name: str,
                  lr: float) -> Path:
    from tiny_speculators.models import get_family
    from tiny_speculators.models.checkpoint import save_draft
    from tiny_speculators.models.family import BuildInputs
    from tiny_speculators.options import options_record, parse_options
    from tiny_speculators.verifier.head import TargetHead

    family = get_family(algorithm)
    opts = parse_options(family.options, options, algorithm)
    inputs = BuildInputs(verifier_config=model.config, d2t=d2t, t2d=t2d, aux_layer_ids=aux_ids,
                         embed_weight=parts.embed_tokens.weight.detach(), lm_head_weight=parts.lm_head.weight.detach(),
                         verifier_path=str(verifier_dir))
    draft = family.build(inputs, opts)
    objective = family.objective(draft, TargetHead(parts.norm, parts.lm_head), opts, "sdpa").train()
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    t = ids.shape[1]
    for step in range(steps):
        rows = torch.randperm(len(ids), generator=generator)[:8]
        batch = {"input_ids": ids[rows], "aux_hidden_states": aux[rows], "loss_mask": mask[rows],
                 "last_hidden_state": last[rows], "position_ids": torch.arange(t).expand(len(rows), t)}
        counts = objective.loss_counts(batch)
        result = objective(batch, counts.float().clamp(min=1))
        optimizer.zero_grad(set_to_none=True)
        result.loss.backward()
        optimizer.step()
        if step % 25 == 0 or step == steps - 1:
            log.info("%s draft training step %d loss %.3f", algorithm, step, float(result.loss.detach()))
    meta = {"verifier": {"name_or_path": verifier_name,
                         "architectures": list(model.config.architectures or []),
                         "hidden_size": model.config.hidden_size, "vocab_size": model.config.vocab_size},
            "speculative_tokens": family.speculative_tokens(opts),
            "trained_with": {"algorithm": algorithm, **options_record(opts), "mode": "test self-distillation",
                             "steps": steps}}
    save_draft(out, draft.eval(), meta)
    return out
