"""P-EAGLE: the forward pinned to vLLM's equations, training attention == inference attention, COD sampling,
and the one-forward proposer (lossless, one draft forward per step)."""

from __future__ import annotations

import math

import pytest
import torch
from draft_fixtures import DRAFT_VOCAB, VOCAB, fixed_init, ref_rms, ref_rope, tiny_kwargs

from tiny_speculators.models.attention import KVCache
from tiny_speculators.models.peagle.model import PEagleDraft
from tiny_speculators.models.peagle.objective import PEagleObjective, all_anchors, cod_sample, rollout

MASK = 3


def tiny_peagle(num_layers: int = 3, norm_before_residual: bool = False, **kw) -> PEagleDraft:
    kwargs = tiny_kwargs(**kw)
    return fixed_init(PEagleDraft(**kwargs, num_layers=num_layers, mask_token_id=MASK, num_depths=4,
                                  norm_before_residual=norm_before_residual))


def reference_forward(draft: PEagleDraft, ids, hidden, pos):
    """vLLM's ``Eagle3LlamaForCausalLM`` forward for one causal sequence of slots, in float64 with plain loops
    (llama_eagle3.py: layer 0 reads concat(input_layernorm(e), hidden_norm(h)); later layers are plain)."""
    sd = {k: v.double() for k, v in draft.state_dict().items()}
    kw = draft.kwargs
    nh, nkv, hd = kw["num_attention_heads"], kw["num_key_value_heads"], kw["head_dim"]
    t = ids.shape[0]
    e = sd["embed_tokens.weight"][ids]
    h = hidden.double()

    def attn(i, x):
        q = (x @ sd[f"layers.{i}.self_attn.q_proj.weight"].T).view(t, nh, hd)
        k = (x @ sd[f"layers.{i}.self_attn.k_proj.weight"].T).view(t, nkv, hd)
        v = (x @ sd[f"layers.{i}.self_attn.v_proj.weight"].T).view(t, nkv, hd)
        q, k = ref_rope(q, pos), ref_rope(k, pos)
        out = torch.zeros(t, nh, hd, dtype=torch.float64)
        for head in range(nh):
            kv = head // (nh // nkv)
            for s in range(t):  # causal
                scores = torch.stack([q[s, head] @ k[j, kv] for j in range(s + 1)]) / math.sqrt(hd)
                out[s, head] = torch.softmax(scores, 0) @ v[: s + 1, kv]
        return out.reshape(t, nh * hd) @ sd[f"layers.{i}.self_attn.o_proj.weight"].T

    def mlp(i, x):
        g = x @ sd[f"layers.{i}.mlp.gate_proj.weight"].T
        u = x @ sd[f"layers.{i}.mlp.up_proj.weight"].T
        return (torch.nn.functional.silu(g) * u) @ sd[f"layers.{i}.mlp.down_proj.weight"].T

    hn = ref_rms(h, sd["layers.0.hidden_norm.weight"])
    res = hn if kw["norm_before_residual"] else h
    x = res + attn(0, torch.cat([ref_rms(e, sd["layers.0.input_layernorm.weight"]), hn], -1))
    x = x + mlp(0, ref_rms(x, sd["layers.0.post_attention_layernorm.weight"]))
    for i in range(1, kw["num_layers"]):
        x = x + attn(i, ref_rms(x, sd[f"layers.{i}.input_layernorm.weight"]))
        x = x + mlp(i, ref_rms(x, sd[f"layers.{i}.post_attention_layernorm.weight"]))
    return ref_rms(x, sd["norm.weight"]) @ sd["lm_head.weight"].T  # (T, Vd)


def _slots(draft, aux, ids, a, d):
    """vLLM's slot layout for anchor a: depth-0 slots 0..a, then d mask slots."""
    tokens = torch.cat([ids[1: a + 2], torch.full((d,), MASK)])
    hidden = torch.cat([draft.fuse(aux[: a + 1]), draft.mask_state().expand(d, -1)])
    return tokens, hidden, torch.arange(a + 1 + d)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_forward_matches_vllm_equations(norm_before_residual):
    draft = tiny_peagle(num_layers=3, norm_before_residual=norm_before_residual)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (9,), generator=g)
    aux = torch.randn(9, 48, generator=g)
    tokens, hidden, pos = _slots(draft, aux, ids, a=5, d=3)
    with torch.no_grad():
        ours = draft(tokens[None], hidden[None], pos[None]).logits[0]
        ref = reference_forward(draft, tokens, hidden, pos)
    torch.testing.assert_close(ours.double(), ref, atol=1e-5, rtol=1e-5)


def test_forward_fixed_numbers():
    """Fixed-init draft, fixed inputs: pinned output (catches silent changes to the computation)."""
    draft = tiny_peagle(num_layers=2)
    ids = torch.arange(6) * 5 % VOCAB
    aux = torch.sin(torch.arange(6 * 48, dtype=torch.float32) * 0.37).view(6, 48)
    tokens, hidden, pos = _slots(draft, aux, ids, a=3, d=2)
    with torch.no_grad():
        logits = draft(tokens[None], hidden[None], pos[None]).logits[0]
    assert logits.shape == (6, DRAFT_VOCAB)
    torch.testing.assert_close(logits[:, :3], torch.tensor(EXPECTED), atol=1e-4, rtol=0)


# pinned on CPU fp32 after test_forward_matches_vllm_equations agreed with the float64 reference
EXPECTED = [[0.7432, -0.483, 0.169], [-0.7193, 0.5092, -0.2425], [-0.0019, 0.4513, -0.8504],
            [0.8071, -0.5764, 0.2814], [-1.026, 1.351, -1.5255], [-0.7498, 1.1683, -1.4567]]


def _batch(b=2, t=14, seed=0, packed=False, doc_len=6):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    aux = torch.randn(b, t, 48, generator=g)
    mask = torch.ones(b, t)
    mask[:, :3] = 0
    doc = None
    if packed:
        doc = (torch.arange(t) // doc_len).expand(b, t).clone()
    return ids, aux, mask, doc


@pytest.mark.parametrize(("packed", "t", "sampled"), [(False, 14, False), (True, 14, False), (True, 60, False),
                                                      (True, 60, True)])
def test_training_attention_equals_inference(packed, t, sampled, monkeypatch):
    """Each training element (anchor a, depth d) equals vLLM's inference forward over depth-0 slots of its
    document up to a, then d mask slots (causal): the output at the last slot. Deeper depths run a forward per
    run of documents, over those documents' keys only (at t=60, several per depth); COD-sampled chains too."""
    from tiny_speculators.models.peagle import objective
    from tiny_speculators.models.ttt import positions_from_documents, valid_anchors

    forwards, key_chunks = [], objective.key_chunks
    min_keys = {"min_keys": 0} if t == 60 else {}  # rows this short take one forward by default (min_keys 512)
    monkeypatch.setattr(objective, "key_chunks", lambda *a: forwards.append(key_chunks(*a, **min_keys)) or forwards[-1])
    draft = tiny_peagle(num_layers=2)
    ids, aux, mask, doc = _batch(t=t, packed=packed, doc_len=6 if t < 20 else 20)
    b = ids.shape[0]
    pos = positions_from_documents(doc) if doc is not None else torch.arange(t).expand(b, t)
    valid = valid_anchors(mask, doc, 4).reshape(4, b * t)
    sets = cod_sample(valid, 0.7, 0.3, torch.Generator().manual_seed(0)) if sampled else all_anchors(valid)
    with torch.no_grad():
        outs = rollout(draft, ids, aux, pos, doc, sets)
        checked = 0
        for d in range(4):
            for a in sets[d][valid[d, sets[d]]].tolist():
                row, col = divmod(a, t)
                start = 0 if doc is None else int((doc[row] == doc[row, col]).nonzero()[0])
                seq_ids = ids[row, start:]
                tokens, hidden, p = _slots(draft, aux[row, start:], seq_ids, col - start, d)
                want = draft(tokens[None], hidden[None], p[None], logits=False).hidden_states[0, -1]
                torch.testing.assert_close(outs[d][a], want, atol=1e-5, rtol=1e-5, msg=f"anchor {a} depth {d}")
                checked += 1
    assert checked > 20 and len(forwards) == 3
    if t == 60:
        assert all(len(chunks) > 1 for chunks in forwards)


def test_cod_sampling_is_nested_and_sized():
    valid = torch.ones(5, 100, dtype=torch.bool)
    valid[:, 90:] = False
    sets = cod_sample(valid, 0.7, 0.2, torch.Generator().manual_seed(0))
    assert torch.equal(sets[0], torch.arange(100))
    for d in range(1, 5):
        assert set(sets[d].tolist()) <= set(sets[d - 1].tolist()) and bool(valid[d, sets[d]].all())
        assert len(sets[d]) == round(90 * max(0.7**d, 0.2))


def test_objective_samples_in_training_and_keeps_all_in_eval():
    draft = tiny_peagle(num_layers=2)
    head = torch.nn.Linear(16, VOCAB, bias=False)
    obj = PEagleObjective(draft, head, depths=4, ratio=0.5, ratio_min=0.1)
    ids, aux, mask, _doc = _batch(t=40)
    batch = {"input_ids": ids, "aux_hidden_states": aux, "loss_mask": mask, "last_hidden_state": torch.randn(2, 40, 16),
             "position_ids": torch.arange(40).expand(2, 40)}
    torch.manual_seed(0)
    counts = obj.loss_counts(batch)
    out = obj(batch, counts.float())
    assert torch.equal(out.metrics["count"], counts) and counts[0] > counts[1] > counts[3]
    out.loss.backward()
    assert draft.mask_hidden.grad is not None and draft.mask_hidden.grad.abs().sum() > 0
    obj.eval()
    full = obj({k: v for k, v in batch.items() if not k.startswith("_")})
    assert bool((full.metrics["count"] >= counts).all()) and full.metrics["count"][1] > counts[1]


def test_proposer_is_one_forward_and_matches_a_full_recompute():
    from tiny_speculators.models.peagle.proposer import PEagleProposer
    from tiny_speculators.sampling import SamplingParams

    draft = tiny_peagle(num_layers=2).eval()
    ids, aux, _, _ = _batch(b=1, t=12)
    ids, aux = ids[0], aux[0]
    prop = PEagleProposer(draft)
    prop.commit(ids[1:6].tolist(), aux[:5], 0)  # slots 0..4: (x_{p+1}, aux_p)
    tokens, _ = prop.propose_chain(3, SamplingParams(), None)
    assert prop.draft_forwards == 1 and prop.length == 5
    with torch.no_grad():
        slots, hidden, pos = _slots(draft, aux, ids, a=4, d=2)
        logits = draft(slots[None], hidden[None], pos[None]).logits[0, -3:]
    assert tokens == draft.to_target_ids(logits.argmax(-1)).tolist()
    # the next step: slots 5..7 verified; cache keeps only real slots
    prop.commit(ids[6:9].tolist(), aux[5:8], 5)
    tokens, _ = prop.propose_chain(4, SamplingParams(), None)
    with torch.no_grad():
        slots, hidden, pos = _slots(draft, aux, ids, a=7, d=3)
        logits = draft(slots[None], hidden[None], pos[None]).logits[0, -4:]
    assert tokens == draft.to_target_ids(logits.argmax(-1)).tolist() and prop.draft_forwards == 2


def test_kv_cache_forward_equals_full_forward():
    draft = tiny_peagle(num_layers=3)
    ids, aux, _, _ = _batch(b=1, t=10)
    slots, hidden, pos = _slots(draft, aux[0], ids[0], a=6, d=2)
    caches = [KVCache() for _ in draft.layers]
    with torch.no_grad():
        full = draft(slots[None], hidden[None], pos[None]).logits
        first = draft(slots[None, :5], hidden[None, :5], pos[None, :5], caches=caches).logits
        rest = draft(slots[None, 5:], hidden[None, 5:], pos[None, 5:], caches=caches).logits
    torch.testing.assert_close(torch.cat([first, rest], 1), full, atol=1e-5, rtol=1e-5)


def test_import_a_speculators_written_peagle_checkpoint(tmp_path, tiny_llama_dir):
    """The layout speculators writes (``speculators_model_type: peagle``, a trained ``embed_tokens``, an unused
    ``hidden_norm`` in later layers, ``mask_hidden [1, 1, 3H]``) imports; the draft computes with those weights."""
    import json

    from safetensors.torch import save_file

    from tiny_speculators.models.importing import import_draft

    vc = json.loads((tiny_llama_dir / "config.json").read_text())
    h, v, heads, kv, hd, inter = (vc[k] for k in ("hidden_size", "vocab_size", "num_attention_heads",
                                                  "num_key_value_heads", "head_dim", "intermediate_size"))
    g = torch.Generator().manual_seed(0)
    w = {"fc.weight": torch.randn(h, 3 * h, generator=g) * 0.03, "norm.weight": torch.ones(h),
         "lm_head.weight": torch.randn(v, h, generator=g) * 0.05, "mask_hidden": torch.randn(1, 1, 3 * h, generator=g),
         "embed_tokens.weight": torch.randn(v, h, generator=g) * 0.05}
    for i in range(2):
        p, width = f"layers.{i}.", 2 * h if i == 0 else h
        for name, shape in (("self_attn.q_proj", (heads * hd, width)), ("self_attn.k_proj", (kv * hd, width)),
                            ("self_attn.v_proj", (kv * hd, width)), ("self_attn.o_proj", (h, heads * hd)),
                            ("mlp.gate_proj", (inter, h)), ("mlp.up_proj", (inter, h)), ("mlp.down_proj", (h, inter))):
            w[f"{p}{name}.weight"] = torch.randn(*shape, generator=g) * 0.05
        for name in ("input_layernorm", "post_attention_layernorm", "hidden_norm"):
            w[f"{p}{name}.weight"] = torch.ones(h)
    save_file(w, str(tmp_path / "model.safetensors"))
    layer = {k: vc[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings")}
    cfg = {"architectures": ["PEagleSpeculator"], "speculators_model_type": "peagle", "draft_vocab_size": v,
           "transformer_layer_config": {**layer, "model_type": "llama", "num_hidden_layers": 2},
           "eagle_aux_hidden_state_layer_ids": [2, 4, 5], "mask_token_id": 7, "num_depths": 5,
           "embed_requires_grad": True,
           "speculators_config": {"algorithm": "peagle", "proposal_methods": [{"speculative_tokens": 5}],
                                  "verifier": {"name_or_path": str(tiny_llama_dir)}}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    draft, config = import_draft(tmp_path)
    assert config["model_type"] == "peagle" and config["speculative_tokens"] == 5
    assert config["aux_layer_ids"] == [2, 4, 5]
    assert draft.kwargs["num_layers"] == 2 and draft.mask_token_id == 7 and draft.kwargs["train_embeddings"]
    assert torch.equal(draft.embed_tokens.weight, w["embed_tokens.weight"]) and draft.embed_tokens.weight.requires_grad
    assert torch.equal(draft.mask_hidden, w["mask_hidden"]) and torch.equal(draft.layers[1].mlp.up_proj.weight,
                                                                            w["layers.1.mlp.up_proj.weight"])
