"""Helpers for export tests: random-init draft checkpoints of the tiny verifiers, in our format."""

from __future__ import annotations

from pathlib import Path

import torch


def make_checkpoint(path: Path, verifier_dir: Path, *, draft_vocab: int = 512, seed: int = 0,
                    aux_layer_ids=(2, 4, 5), **overrides) -> Path:
    """A random draft for ``verifier_dir`` saved with ``save_draft`` (embeddings = the verifier's).

    Every weight (norms included) is random, so a round trip that dropped or swapped any tensor shows.
    """
    from transformers import AutoConfig

    from tiny_speculators.models.checkpoint import save_draft
    from tiny_speculators.models.eagle3.family import build_draft, draft_kwargs_from_verifier
    from tiny_speculators.verifier.describe import verifier_embeddings

    config = AutoConfig.from_pretrained(verifier_dir)
    generator = torch.Generator().manual_seed(seed)
    vocab = config.vocab_size
    ids = torch.sort(torch.randperm(vocab, generator=generator)[:draft_vocab]).values
    d2t = ids - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    kwargs = draft_kwargs_from_verifier(config, draft_vocab, num_aux=len(aux_layer_ids), **overrides)
    torch.manual_seed(seed)
    draft = build_draft(kwargs, d2t, t2d, embed_weight=verifier_embeddings(str(verifier_dir)))
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name != "embed_tokens.weight" and p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
    meta = {"aux_layer_ids": list(aux_layer_ids),
            "verifier": {"name_or_path": str(verifier_dir), "architectures": list(config.architectures or []),
                         "hidden_size": config.hidden_size, "vocab_size": vocab},
            "trained_with": {"ttt_steps": 4, "decay": 0.8, "mode": "offline"}}
    save_draft(path, draft, meta)
    return path


def fixed_batch(kwargs: dict, seed: int = 1, batch: int = 2, length: int = 7):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, kwargs["vocab_size"], (batch, length), generator=g)
    aux = torch.randn(batch, length, kwargs["num_aux"] * kwargs["target_hidden_size"], generator=g)
    positions = torch.arange(length).expand(batch, length)
    return ids, aux, positions


def draft_logits(draft, batch) -> torch.Tensor:
    """Two draft steps (fused verifier states, then the draft's own output fed back): exercises every weight."""
    from tiny_speculators.models.attention import KVCache

    ids, aux, positions = batch
    cache = KVCache()
    with torch.no_grad():
        first = draft(ids, draft.fuse(aux), positions, cache=cache)
        second = draft(ids[:, -1:], first.hidden_states[:, -1:], positions[:, -1:] + 1, cache=cache)
    return torch.cat([first.logits, second.logits], dim=1)
