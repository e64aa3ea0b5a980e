"""The guard against bad hidden states: each fault stops extraction in one line naming shard, sample and layer,
keeps the shards already written, and a rerun after the fix resumes to the same result as an uninterrupted run."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tiny_speculators.errors import UserError
from tiny_speculators.storage.reader import HiddenStateReader
from tiny_speculators.verifier.extract import extract
from tiny_speculators.verifier.guard import GUARD_POSITIONS, GUARD_TOKENS, Guard, default_agreement
from tiny_speculators.verifier.head import TargetHead

SMALL = dict(shard_mb=0.05, max_tokens_per_batch=40, progress=False)  # ~50 tokens per shard
H, V = 8, 16


def _head() -> TargetHead:
    torch.manual_seed(0)
    return TargetHead(torch.nn.LayerNorm(H), torch.nn.Linear(H, V, bias=False))


def _sample(head: TargetHead, n: int = 6, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    last = torch.randn(n, H, generator=g)
    positions = torch.arange(n)
    with torch.no_grad():
        choices = head(last).argmax(-1)
    return {"aux": torch.randn(n, 2 * H, generator=g), "last": last, GUARD_POSITIONS: positions,
            GUARD_TOKENS: choices}


def test_good_states_pass_and_are_counted():
    head = _head()
    guard = Guard([2, 5], H, head, 0.99)
    guard.check_shard(0, 0, [_sample(head), _sample(head, seed=2)])
    assert (guard.checked, guard.agreed) == (12, 12)


@pytest.mark.parametrize(("fault", "message"), [
    (lambda aux: aux.zero_(), "aux layer 5 of sample 8 is all zeros"),
    (lambda aux: aux.fill_(0.25), r"aux layer 5 of sample 8 holds the same value \(0.25\) everywhere"),
    (lambda aux: aux.__setitem__((3, 1), float("nan")), "aux layer 5 of sample 8 holds NaN or infinite values"),
])
def test_bad_aux_states_name_shard_sample_and_layer(fault, message):
    head = _head()
    bad = _sample(head)
    fault(bad["aux"][:, H:])  # the second aux layer (id 5)
    with pytest.raises(UserError, match=f"^shard 3: {message}"):
        Guard([2, 5], H, head, 0.99).check_shard(3, 7, [_sample(head), bad])


def test_states_that_miss_the_verifiers_choice_stop_it():
    head = _head()
    bad = _sample(head)
    bad["last"] = torch.zeros_like(bad["last"]) + torch.randn(H)  # one state everywhere: one choice everywhere
    guard = Guard([2, 5], H, head, 0.99)
    with pytest.raises(UserError, match=r"shard 0: .* at only \d of 12 checked positions .* first miss: sample 1"):
        guard.check_shard(0, 0, [_sample(head), bad])
    Guard([2, 5], H, head, 0.0).check_shard(0, 0, [_sample(head), bad])  # 0: only the aux checks
    lenient = Guard([2, 5], H, head, 0.5)
    lenient.check_shard(0, 0, [_sample(head), _sample(head, seed=3), bad])
    assert lenient.checked == 18 and lenient.agreed >= 12


def test_topk_layouts_are_checked_by_their_stored_top_ids():
    head = _head()
    sample = _sample(head)
    sample["topk_ids"] = torch.stack([sample[GUARD_TOKENS], (sample[GUARD_TOKENS] + 1) % V], -1)
    del sample["last"]
    Guard([2, 5], H, None, 0.99).check_shard(0, 0, [sample])
    sample["topk_ids"] = sample["topk_ids"].flip(-1)
    with pytest.raises(UserError, match="at only 0 of 6"):
        Guard([2, 5], H, None, 0.99).check_shard(0, 0, [sample])


def test_default_agreement_by_dtype():
    assert default_agreement("float32") == 0.99 and default_agreement("bfloat16") == 0.9


def test_extraction_counts_what_it_checked(tmp_path, prepared_llama):
    summary = extract(data=prepared_llama, out=tmp_path / "out", **SMALL)
    assert summary["guard_positions"] > 0 and summary["guard_agreed"] == summary["guard_positions"]


def _shards(out):
    return {p.name: load_file(str(p)) for p in sorted(out.glob("shard-*.safetensors"))}


def test_a_dropped_aux_transfer_stops_extraction_and_a_fixed_rerun_resumes(tmp_path, prepared_llama, monkeypatch):
    """The fault peers' users met: one aux layer's states arrive as zeros from the second shard on."""
    import tiny_speculators.verifier.extract as stage

    run_shard, calls = stage._run_shard, []

    def dropping(*args, **kwargs):
        samples = run_shard(*args, **kwargs)
        calls.append(1)
        if len(calls) > 1:
            for sample in samples:
                sample["aux"] = sample["aux"].clone()
                sample["aux"][:, 64:128] = 0  # aux layer 4 (of 2, 4, 5) lost
        return samples

    reference = tmp_path / "reference"
    extract(data=prepared_llama, out=reference, **SMALL)
    out = tmp_path / "out"
    monkeypatch.setattr(stage, "_run_shard", dropping)
    with pytest.raises(UserError, match=r"^shard \d+: aux layer 4 of sample \d+ is all zeros: .* a rerun resumes"):
        extract(data=prepared_llama, out=out, **SMALL)
    kept = _shards(out)
    assert kept and len(kept) < len(_shards(reference))  # what was written before the fault stays
    monkeypatch.setattr(stage, "_run_shard", run_shard)
    extract(data=prepared_llama, out=out, **SMALL)
    done, want = _shards(out), _shards(reference)
    assert done.keys() == want.keys()
    for name in want:
        for key in want[name]:
            assert torch.equal(done[name][key], want[name][key]), (name, key)
    assert HiddenStateReader(out).manifest["tokens"] == HiddenStateReader(reference).manifest["tokens"]


def test_last_states_of_another_layer_stop_extraction(tmp_path, prepared_llama, monkeypatch):
    """A last-layer state that is not the verifier's (here an aux layer's, as when a hybrid block is skipped)."""
    import tiny_speculators.verifier.extract as stage

    capture = stage.capture_hidden_states
    monkeypatch.setattr(stage, "capture_hidden_states",
                        lambda *a, **k: (lambda aux, last: (aux, aux[..., :last.shape[-1]].clone()))(*capture(*a, **k)))
    with pytest.raises(UserError, match=r"^shard 0: the stored last-layer states reproduce the verifier's own next "
                                        r"token at only \d+ of \d+ checked positions"):
        extract(data=prepared_llama, out=tmp_path / "out", **SMALL)
    assert not list((tmp_path / "out").glob("shard-*.safetensors"))
