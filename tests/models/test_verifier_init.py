"""``init: verifier`` (EAGLE-3's and P-EAGLE's options): a fresh draft whose decoder layers are verifier layers is an
early exit of the verifier. Without the input norms its first step (P-EAGLE: its depth-0 slots) reproduces the
verifier's logits after those layers exactly."""

from __future__ import annotations

import pytest
import torch

from tiny_speculators.errors import UserError
from tiny_speculators.models.eagle3.family import Eagle3Options, build
from tiny_speculators.models.family import BuildInputs
from tiny_speculators.models.peagle import family as peagle

FAMILIES = {"eagle3": (build, Eagle3Options), "peagle": (peagle.build, peagle.PEagleOptions)}


def _inputs(folder, verifier, aux: list[int]) -> BuildInputs:
    vocab = verifier.config.vocab_size
    t2d = torch.ones(vocab, dtype=torch.bool)  # the whole vocabulary: logits compare one to one
    return BuildInputs(verifier_config=verifier.config, d2t=torch.zeros(vocab, dtype=torch.long), t2d=t2d,
                       aux_layer_ids=aux, embed_weight=verifier.get_input_embeddings().weight.detach(),
                       lm_head_weight=verifier.get_output_embeddings().weight.detach(), verifier_path=str(folder))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("layer", [None, 3])
@pytest.mark.parametrize("num_layers", [1, 2])
def test_fresh_draft_is_the_verifiers_early_exit(family, arch, layer, num_layers, tiny_llama_dir, tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM

    folder = tiny_llama_dir if arch == "llama" else tiny_qwen3_dir
    verifier = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    aux = [2, 4, 5]
    build_family, options = FAMILIES[family]
    draft = build_family(_inputs(folder, verifier, aux),
                         options(init="verifier", init_layer=layer, num_layers=num_layers, norm_before_residual=False))
    j = aux[-1] if layer is None else layer
    ids = torch.randint(0, verifier.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(11)[None].expand(2, -1)
    with torch.no_grad():
        states = verifier(ids, output_hidden_states=True).hidden_states  # states[j]: the input of layer j
        # the verifier's early exit: layer j on states[j], then its final norm and lm_head
        body = verifier.model
        cos_sin = body.rotary_emb(states[j], positions)
        mask = torch.ones(11, 11, dtype=torch.bool).tril()[None, None].expand(2, 1, -1, -1)
        after = states[j]
        for layer_j in body.layers[j:j + num_layers]:  # the verifier's layers j, j+1, ...
            after = layer_j(after, attention_mask=torch.where(mask, 0.0, float("-inf")), position_ids=positions,
                            position_embeddings=cos_sin)
            after = after[0] if isinstance(after, tuple) else after
        expected = verifier.lm_head(body.norm(after))
        aux_states = torch.cat([states[i] for i in aux], dim=-1)
        if j not in aux:  # fc picks the last aux state: feed layer j's input in its place
            aux_states = torch.cat([states[i] for i in aux[:-1]] + [states[j]], dim=-1)
        got = draft(ids, draft.fuse(aux_states), positions).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(draft.layers[0].mlp.down_proj.weight, body.layers[j].mlp.down_proj.weight)
    assert not draft.layers[0].self_attn.q_proj.weight[:, :draft.hidden_size].any()  # embedding half starts at 0


@pytest.mark.parametrize("family", FAMILIES)
def test_a_layer_the_verifier_lacks_is_a_one_line_error(family, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    verifier = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    build_family, options = FAMILIES[family]
    with pytest.raises(UserError, match=rf"^{family} init_layer 8 is not a decoder layer of the verifier \(0\.\.7\)$"):
        build_family(_inputs(tiny_llama_dir, verifier, [2, 4, 5]), options(init="verifier", init_layer=8, num_layers=1))
    with pytest.raises(UserError, match=rf"^{family} init_layer 7 with num_layers 2 copies verifier layers 7\.\.8, "
                                        r"but its decoder layers are 0\.\.7$"):
        build_family(_inputs(tiny_llama_dir, verifier, [2, 4, 5]),
                     options(init="verifier", init_layer=7, num_layers=2))
