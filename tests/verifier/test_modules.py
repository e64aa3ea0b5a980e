"""find_parts locates layers, final norm, lm_head and embedding in plain and wrapped module trees."""

from __future__ import annotations

import pytest
from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.verifier.load import load_verifier
from tiny_speculators.verifier.modules import find_parts


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_verifier(tiny_llama_dir, with_tokenizer=False)[0]


def test_plain_llama_and_qwen3(llama, tiny_qwen3_dir):
    parts = find_parts(llama)
    assert parts.layers is llama.model.layers and parts.norm is llama.model.norm
    assert parts.lm_head is llama.lm_head and parts.embed_tokens is llama.model.embed_tokens
    assert (parts.num_hidden_layers, parts.hidden_size) == (8, 64)
    assert (parts.layers_name, parts.norm_name, parts.lm_head_name) == ("model.layers", "model.norm", "lm_head")
    qwen3 = load_verifier(tiny_qwen3_dir, with_tokenizer=False)[0]
    assert find_parts(qwen3).layers is qwen3.model.layers


@pytest.mark.parametrize("style", ["new", "old", "outer-norm"])
def test_wrapped_layouts(tiny_llama_dir, wrap, style):
    lm = load_verifier(tiny_llama_dir, with_tokenizer=False)[0]
    layers, norm, head, embed = lm.model.layers, lm.model.norm, lm.lm_head, lm.model.embed_tokens
    parts = find_parts(wrap(lm, style))
    assert parts.layers is layers and parts.norm is norm and parts.lm_head is head and parts.embed_tokens is embed
    assert parts.decoder is lm.model and parts.num_hidden_layers == 8
    expected = {"new": "model.language_model.layers", "old": "language_model.model.layers",
                "outer-norm": "model.language_model.layers"}[style]
    assert parts.layers_name == expected


def test_missing_layers_is_a_clear_error():
    model = nn.Module()
    model.embed_tokens = nn.Embedding(10, 4)
    model.lm_head = nn.Linear(4, 10, bias=False)
    with pytest.raises(UserError, match="cannot identify the decoder layers.*no ModuleList next to"):
        find_parts(model)


def test_ambiguous_norm_is_a_clear_error():
    model = nn.Module()
    model.decoder = nn.Module()
    model.decoder.embed_tokens = nn.Embedding(10, 4)
    model.decoder.layers = nn.ModuleList([nn.Linear(4, 4)])
    model.decoder.pre_norm = nn.LayerNorm(4)
    model.decoder.post_norm = nn.LayerNorm(4)
    model.lm_head = nn.Linear(4, 10, bias=False)
    with pytest.raises(UserError, match=r"final norm.*decoder.pre_norm.*decoder.post_norm"):
        find_parts(model)
    del model.decoder.pre_norm
    assert find_parts(model).norm is model.decoder.post_norm


def test_missing_lm_head_is_a_clear_error():
    model = nn.Module()
    model.embed_tokens = nn.Embedding(10, 4)
    model.layers = nn.ModuleList([nn.Linear(4, 4)])
    with pytest.raises(UserError, match=r"lm_head.*\(10, 4\)"):
        find_parts(model)
