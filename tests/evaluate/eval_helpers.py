"""Test helpers for the evaluate tests: random EAGLE-3 drafts and an oracle (perfect) draft; a verifier loaded
for exact checks, its own greedy generation, random prompts, the exact distributions of its next tokens and a
chi-square test against them."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from tiny_speculators.models.eagle3.family import build_draft, draft_kwargs_from_verifier
from tiny_speculators.models.eagle3.proposer import Eagle3Proposer


def random_draft(model, draft_vocab: int | None = None, seed: int = 0, std: float = 0.02):
    """A randomly initialised draft for ``model``; a random subset of ``draft_vocab`` target ids."""
    vocab = model.config.vocab_size
    draft_vocab = draft_vocab or vocab
    g = torch.Generator().manual_seed(seed)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.randperm(vocab, generator=g)[:draft_vocab]] = True
    d2t = torch.nonzero(t2d).flatten() - torch.arange(draft_vocab)
    torch.manual_seed(seed)
    draft = build_draft(draft_kwargs_from_verifier(model.config, draft_vocab), d2t, t2d,
                        embed_weight=model.get_input_embeddings().weight)
    if std != 0.02:
        draft.reset_parameters(std)
        draft.embed_tokens.weight.data.copy_(model.get_input_embeddings().weight)
    return draft.eval().requires_grad_(False)


def save_random_checkpoint(verifier_dir, path, seed: int = 0):
    """A random EAGLE-3 draft of the tiny Llama verifier at ``verifier_dir`` (4000-token draft vocabulary, aux layers
    2, 4, 5), saved as our checkpoint in ``path``."""
    from tiny_speculators.models.checkpoint import save_draft

    model = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32)
    save_draft(path, random_draft(model, draft_vocab=4000, seed=seed), {
        "aux_layer_ids": [2, 4, 5],
        "verifier": {"name_or_path": str(verifier_dir), "architectures": ["LlamaForCausalLM"],
                     "hidden_size": 64, "vocab_size": model.config.vocab_size}})
    return path


class OracleProposer(Eagle3Proposer):
    """A real draft (real KV-cache bookkeeping) whose logits are replaced by a peak on the reference
    continuation: at draft position t it predicts ``reference[t + 2]``, as a perfect draft would."""

    def __init__(self, draft, reference: list[int]):
        super().__init__(draft)
        assert draft.draft_vocab_size == self.vocab_size and int(draft.d2t.abs().sum()) == 0
        self.reference = reference

    def _oracle(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = logits.clone()
        for row, p in enumerate(positions.tolist()):
            out[row, self.reference[p + 2]] = out[row].max() + 10.0
        return out

    def commit(self, tokens, aux, start):
        super().commit(tokens, aux, start)
        self.logits = self._oracle(self.logits[None], torch.tensor([start + len(tokens) - 1]))[0]

    def step(self, tokens, hidden, positions, mask=None):
        logits, hid = super().step(tokens, hidden, positions, mask)
        return self._oracle(logits, positions), hid


def self_distilled_draft(model, aux_layer_ids, *, num_seqs=16, prompt_len=8, new_tokens=56, steps=200,
                         ttt_steps=3, lr=3e-3, seed=0, **draft_overrides):
    """Train a tiny draft on the verifier's own greedy continuations of random prompts (TTT loss).

    Returns a dict: ``draft``, ``seqs`` [B, T] (prompt + greedy continuation), ``aux`` [B, T, n_aux*H],
    ``prompt_len`` and ``metrics`` (teacher-forced TTT metrics of the final draft on that data)."""
    from tiny_speculators.models.metrics import summarize_metrics
    from tiny_speculators.models.ttt import ttt_step
    from tiny_speculators.verifier.capture import capture_hidden_states
    from tiny_speculators.verifier.modules import find_parts

    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab, (num_seqs, prompt_len), generator=g)
    with torch.no_grad():
        seqs = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                              do_sample=False, eos_token_id=None, pad_token_id=0)  # (B, T)
        aux, last = capture_hidden_states(model, seqs, torch.ones_like(seqs), aux_layer_ids)
    aux, last = aux.clone(), last.clone()  # capture may run in inference mode
    parts = find_parts(model)
    with torch.no_grad():
        target_logits = parts.lm_head(parts.norm(last))  # (B, T, V)
    used = torch.unique(seqs)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    d2t = used - torch.arange(len(used))
    torch.manual_seed(seed)
    kwargs = draft_kwargs_from_verifier(model.config, len(used), **draft_overrides)
    draft = build_draft(kwargs, d2t, t2d, embed_weight=parts.embed_tokens.weight,
                        lm_head_weight=parts.lm_head.weight)
    loss_mask = torch.zeros_like(seqs)
    loss_mask[:, prompt_len:] = 1
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    draft.train()
    for _ in range(steps):
        out = ttt_step(draft, input_ids=seqs, aux_hidden_states=aux, loss_mask=loss_mask,
                       target_logits=target_logits, steps=ttt_steps, decay=0.8, checkpoint=False)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    draft.eval().requires_grad_(False)
    with torch.no_grad():
        out = ttt_step(draft, input_ids=seqs, aux_hidden_states=aux, loss_mask=loss_mask,
                       target_logits=target_logits, steps=ttt_steps, checkpoint=False)
    return {"draft": draft, "seqs": seqs, "aux": aux, "prompt_len": prompt_len,
            "metrics": summarize_metrics(out.metrics)}


def load_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def random_prompts(vocab, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def exact_marginals(model, prompt, params, steps=3):
    """Exact verifier distributions of the 2nd and 3rd generated tokens (enumerating the vocab)."""
    from tiny_speculators.sampling import probs_from_logits

    v = model.config.vocab_size
    p1 = probs_from_logits(model(torch.tensor([prompt])).logits[0, -1], params)  # (V,)
    seq = torch.cat([torch.tensor(prompt).repeat(v, 1), torch.arange(v)[:, None]], dim=1)
    p2_given = probs_from_logits(model(seq).logits[:, -1], params)  # (V, V)
    seq2 = torch.cat([seq.repeat_interleave(v, 0), torch.arange(v).repeat(v)[:, None]], dim=1)
    p3_given = probs_from_logits(model(seq2).logits[:, -1], params).view(v, v, v)
    joint12 = p1[:, None] * p2_given  # (V, V)
    return joint12.sum(0), (joint12[:, :, None] * p3_given).sum((0, 1))


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled into one."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
