"""The family contract: every family in ``models.FAMILIES`` goes through everything the stages ask of it.

build -> save -> load -> objective step (loss, counts, metric sums, summary) -> proposer (commit, chain) ->
export in each of its formats -> import round trip; and its options reject a typo with the key's name.
A family that ``reads_verifier_files`` (MTP: the verifier's own layer) runs on a tiny verifier that ships them
(MiMo layout); one with ``fixed_aux_layer_ids`` reads its own layers instead of ``AUX``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tiny_speculators.errors import UserError
from tiny_speculators.models import FAMILIES, family_of, get_family
from tiny_speculators.models.checkpoint import save_draft
from tiny_speculators.models.family import (
    DRAFT_KWARGS,
    BuildInputs,
    DraftModel,
    ExportInfo,
    Objective,
    Proposer,
)
from tiny_speculators.models.importing import import_draft, load_draft
from tiny_speculators.options import parse_options

AUX = [2, 4, 5]


def _verifier(path):
    from tiny_speculators.verifier.head import load_verifier_head
    from tiny_speculators.verifier.load import load_verifier

    model, _ = load_verifier(str(path), with_tokenizer=False)
    return model, load_verifier_head(str(path))


@pytest.fixture(scope="module")
def verifiers(tiny_llama_dir, request):
    """(folder, model, head) per kind, loaded once: 'plain' (Llama) and 'own weights' (MiMo with an MTP layer)."""
    loaded = {}

    def get(own_weights: bool):
        if own_weights not in loaded:
            path = request.getfixturevalue("tiny_mimo_dir") if own_weights else tiny_llama_dir
            loaded[own_weights] = (path, *_verifier(path))
        return loaded[own_weights]

    return get


def _inputs(head, aux: list[int], path, draft_vocab: int = 64) -> BuildInputs:
    vocab = head.config.vocab_size
    target_ids = torch.arange(0, 2 * draft_vocab, 2)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    return BuildInputs(verifier_config=head.config, d2t=target_ids - torch.arange(draft_vocab), t2d=t2d,
                       aux_layer_ids=aux, embed_weight=head.embed_weight.float(),
                       lm_head_weight=head.target_head.lm_head.weight.float(), verifier_path=str(path))


def _batch(model, aux_ids: list[int], n: int = 2, t: int = 24, seed: int = 0) -> dict:
    from tiny_speculators.verifier.capture import capture_hidden_states

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (n, t), generator=g)
    aux, last = capture_hidden_states(model, ids, torch.ones_like(ids), aux_ids)
    mask = torch.ones(n, t)
    mask[:, :4] = 0
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(t).expand(n, t), "aux_hidden_states": aux.clone(),
            "last_hidden_state": last.clone()}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_contract(name, verifiers, tmp_path):
    family = get_family(name)
    tiny_llama_dir, model, head = verifiers(family.reads_verifier_files)
    aux = family.default_aux_layer_ids(model.config.num_hidden_layers) if family.fixed_aux_layer_ids else AUX
    options = family.options()
    torch.manual_seed(0)
    draft = family.build(_inputs(head, AUX, tiny_llama_dir), options)
    assert family_of(draft) is family and draft.kwargs["aux_layer_ids"] == aux
    assert isinstance(draft, DraftModel) and set(DRAFT_KWARGS) <= set(draft.kwargs)  # what the stages read

    # save -> load: same weights, same config
    save_draft(tmp_path / "ckpt", draft, {"verifier": {"name_or_path": str(tiny_llama_dir), "architectures": [],
                                                       "hidden_size": 64, "vocab_size": model.config.vocab_size}})
    loaded, config = load_draft(tmp_path / "ckpt")
    assert type(loaded) is type(draft) and config["model_type"] == name and config["aux_layer_ids"] == aux
    for (k1, v1), (k2, v2) in zip(draft.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert k1 == k2 and torch.equal(v1, v2), k1

    # objective: a differentiable loss, counts that normalize it, metric sums its summary reads
    objective = family.objective(draft, head.target_head, options, "sdpa")
    assert isinstance(objective, Objective)
    batch = _batch(model, aux)
    counts = objective.loss_counts(batch)
    out = objective(batch, counts.float().clamp(min=1))
    out.loss.backward()
    assert torch.isfinite(out.loss) and any(p.grad is not None for p in draft.parameters() if p.requires_grad)
    stats = objective.new_stats(torch.device("cpu"))
    assert set(stats) == set(out.metrics)
    for k in stats:
        stats[k] += out.metrics[k]
    summary = objective.summarize(stats)
    assert {"loss", "accept_len"} <= set(summary) and summary["accept_len"] >= 1.0

    # proposer: commit verified features, propose k tokens, count draft forwards
    proposer = family.proposer(loaded.eval())
    assert isinstance(proposer, Proposer)
    from tiny_speculators.sampling import SamplingParams

    proposer.reset()
    ids = batch["input_ids"][0, :10].tolist()
    proposer.commit([*ids[1:], ids[0]], batch["aux_hidden_states"][0, :10], 0)
    before = proposer.draft_forwards
    tokens, q = proposer.propose_chain(3, SamplingParams(), None)
    assert len(tokens) == 3 and q is None and all(0 <= t < model.config.vocab_size for t in tokens)
    assert proposer.draft_forwards > before

    # every format: write, read back, same draft
    for fmt in family.formats:
        cfg, tensors = fmt.write(loaded, ExportInfo(verifier_name=str(tiny_llama_dir), verifier_architectures=[],
                                                   speculative_tokens=3, dtype=torch.float32))
        folder = tmp_path / fmt.name
        folder.mkdir()
        from safetensors.torch import save_file

        from tiny_speculators.atomic import write_json_atomic

        save_file(tensors, str(folder / "model.safetensors"))
        write_json_atomic(folder / "config.json", cfg)
        assert fmt.detect(cfg)
        back, back_cfg = import_draft(folder, verifier=str(tiny_llama_dir))
        assert back_cfg["model_type"] == name and back_cfg["aux_layer_ids"] == aux, fmt.name
        for key, value in loaded.state_dict().items():
            torch.testing.assert_close(back.state_dict()[key], value, atol=0, rtol=0, msg=f"{fmt.name}: {key}")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_options_name_the_bad_key(name):
    family = get_family(name)
    with pytest.raises(UserError, match=rf"train\.{name}: unknown option\(s\) no_such_option"):
        parse_options(family.options, {"no_such_option": 1}, f"train.{name}")
    first = dataclasses.fields(family.options)[0]
    with pytest.raises(UserError, match=rf"train\.{name}\.{first.name}"):
        parse_options(family.options, {first.name: "not a number" if first.type != "str" else 3}, f"train.{name}")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_objective_takes_the_runs_loss_choice(name, verifiers):
    """The loss choice reaches every family through the seam: the family default equals no choice; another term,
    and D-PACE weights, change the loss, which stays differentiable; the metric sums still add up."""
    from tiny_speculators.models.losses import LossSpec

    family = get_family(name)
    tiny_llama_dir, model, head = verifiers(family.reads_verifier_files)
    aux = family.default_aux_layer_ids(model.config.num_hidden_layers) if family.fixed_aux_layer_ids else AUX
    torch.manual_seed(0)
    # a draft vocab of half the verifier's, so the verifier's argmax is often a draft token (CE is not all 0);
    # {ce: 0.3, tv: 0.7} is no family's default (EAGLE-3: kl, DFlash: ce, DSpark: 0.1 ce + 0.9 tv)
    draft = family.build(_inputs(head, AUX, tiny_llama_dir, draft_vocab=head.config.vocab_size // 2), family.options())
    batch = _batch(model, aux, seed=3)
    losses = {}
    for key, spec in [("none", None), ("default", LossSpec()), ("tv", LossSpec.from_mapping({"ce": 0.3, "tv": 0.7})),
                      ("lk-dpace", LossSpec.from_mapping({"lk": 1.0}, position_weights="dpace"))]:
        objective = family.objective(draft, head.target_head, family.options(), "sdpa", loss=spec).eval()
        counts = objective.loss_counts(batch)  # eval(): every anchor, so each spec sees the same positions
        out = objective(batch, counts.float().clamp(min=1))
        draft.zero_grad()
        out.loss.backward()
        assert torch.isfinite(out.loss) and any(p.grad is not None and p.grad.abs().sum() > 0
                                                for p in draft.parameters() if p.requires_grad), key
        losses[key] = out.loss.item()
    assert losses["none"] == losses["default"]
    assert len({round(v, 6) for v in losses.values()}) == 3, losses
