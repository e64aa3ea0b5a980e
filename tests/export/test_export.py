"""Export -> import round trips (speculators and SGLang formats), config contents, and clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from export_helpers import draft_logits, fixed_batch, make_checkpoint
from safetensors.torch import load_file

from tiny_speculators.errors import UserError
from tiny_speculators.export import export, import_draft
from tiny_speculators.models.importing import load_draft


def assert_same_draft(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name
    assert a.kwargs == b.kwargs
    batch = fixed_batch(a.kwargs)
    assert torch.equal(draft_logits(a, batch), draft_logits(b, batch))


@pytest.mark.parametrize("fmt", ["speculators", "eagle3-sglang"])
def test_round_trip_llama(tmp_path, llama_checkpoint, tiny_llama_dir, fmt):
    original, _ = load_draft(llama_checkpoint)
    summary = export(llama_checkpoint, out=tmp_path / "out", format=fmt, verifier_name=str(tiny_llama_dir))
    assert summary["format"] == fmt and "embed_tokens.weight" not in summary["tensors"]
    imported, config = import_draft(tmp_path / "out", verifier=str(tiny_llama_dir))
    assert_same_draft(original, imported)
    assert config["aux_layer_ids"] == [2, 4, 5]
    assert config["source"]["format"] == fmt
    assert config["verifier"]["name_or_path"] == str(tiny_llama_dir.resolve())


def test_round_trip_qwen3_with_norm_flags(tmp_path, qwen3_checkpoint, tiny_qwen3_dir):
    original, _ = load_draft(qwen3_checkpoint)
    assert original.kwargs["norm_before_residual"] and original.kwargs["fc_norm"]
    export(qwen3_checkpoint, out=tmp_path / "out", verifier_name=str(tiny_qwen3_dir))
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert {"layers.0.self_attn.q_norm.weight", "fc_norm.0.weight", "fc_norm.2.weight"} <= set(weights)
    imported, _ = import_draft(tmp_path / "out")  # verifier taken from the config's name_or_path
    assert_same_draft(original, imported)
    # Speculators -> SGLang is refused: SGLang's Llama draft layer has no q/k norms.
    with pytest.raises(UserError, match="SGLang.*cannot run a draft with layer_type 'qwen3'"):
        export(tmp_path / "out", out=tmp_path / "sgl", format="eagle3-sglang")


def test_round_trip_of_a_two_layer_draft(tmp_path, tiny_llama_dir):
    ckpt = make_checkpoint(tmp_path / "ckpt", tiny_llama_dir, num_layers=2, norm_before_residual=True, seed=5)
    original, _ = load_draft(ckpt)
    export(ckpt, out=tmp_path / "out", verifier_name=str(tiny_llama_dir))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "layers.1.input_layernorm.weight" in weights and "layers.1.hidden_norm.weight" not in weights
    # speculators may write a hidden_norm for every layer; only layer 0 runs one
    weights["layers.1.hidden_norm.weight"] = torch.ones(original.hidden_size)
    from safetensors.torch import save_file

    save_file(weights, str(tmp_path / "out" / "model.safetensors"))
    imported, _ = import_draft(tmp_path / "out")
    assert_same_draft(original, imported)
    with pytest.raises(UserError, match=r"SGLang.*cannot run a draft with norm_before_residual, "
                                        r"2 decoder layers \(its midlayer is one\)"):
        export(ckpt, out=tmp_path / "sgl", format="eagle3-sglang", verifier_name=str(tiny_llama_dir))


def test_a_sliding_window_draft_round_trips_through_the_speculators_format(tmp_path, tiny_llama_dir):
    """The window travels as vLLM's EAGLE-3 draft classes read it (``layer_types`` + ``sliding_window``); SGLang's
    format has no window, and a config mixing layer kinds is refused in one line."""
    ckpt = make_checkpoint(tmp_path / "ckpt", tiny_llama_dir, num_layers=2, sliding_window=6, seed=7)
    original, _ = load_draft(ckpt)
    export(ckpt, out=tmp_path / "out", verifier_name=str(tiny_llama_dir))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    layer = cfg["transformer_layer_config"]
    assert layer["layer_types"] == ["sliding_attention"] * 2 and layer["sliding_window"] == 6
    imported, _ = import_draft(tmp_path / "out")
    assert imported.kwargs["sliding_window"] == 6
    assert_same_draft(original, imported)
    with pytest.raises(UserError, match=r"SGLang.*cannot run a draft with .*a sliding window of 6"):
        export(ckpt, out=tmp_path / "sgl", format="eagle3-sglang", verifier_name=str(tiny_llama_dir))
    layer["layer_types"] = ["sliding_attention", "full_attention"]
    (tmp_path / "out" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"layer_types \['sliding_attention', 'full_attention'\] is not supported"):
        import_draft(tmp_path / "out")


def test_a_whole_vocabulary_draft_is_written_without_vocab_maps(tmp_path, tiny_llama_dir):
    """vLLM's EAGLE-3 model has no d2t parameter when the draft vocabulary is the verifier's, and refuses one."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_llama_dir).vocab_size
    ckpt = make_checkpoint(tmp_path / "ckpt", tiny_llama_dir, draft_vocab=vocab, seed=6)
    original, _ = load_draft(ckpt)
    export(ckpt, out=tmp_path / "out", verifier_name=str(tiny_llama_dir))
    assert not {"d2t", "t2d"} & set(load_file(str(tmp_path / "out" / "model.safetensors")))
    imported, _ = import_draft(tmp_path / "out")
    assert_same_draft(original, imported)


def test_speculators_config_fields(tmp_path, llama_checkpoint, tiny_llama_dir):
    export(llama_checkpoint, out=tmp_path / "out", verifier_name=str(tiny_llama_dir), speculative_tokens=5,
           dtype="bfloat16")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["draft_vocab_size"] == 512
    assert "target_hidden_size" not in cfg  # same hidden size as the verifier
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["norm_before_residual"] is False and cfg["norm_before_fc"] is False and cfg["fc_norm"] is False
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert (layer["vocab_size"], layer["hidden_size"], layer["intermediate_size"]) == (49152, 64, 128)
    assert (layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]) == (2, 1, 32)
    assert layer["rms_norm_eps"] == 1e-6 and layer["max_position_embeddings"] == 512
    assert layer["rope_theta"] == layer["rope_parameters"]["rope_theta"]
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 5, "verifier_accept_k": 1,
                                         "accept_tolerance": 0.0}]
    assert spec["verifier"] == {"name_or_path": str(tiny_llama_dir.resolve()), "architectures": ["LlamaForCausalLM"]}
    assert cfg["speculators_version"]
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert weights["fc.weight"].dtype == torch.bfloat16 and weights["d2t"].dtype == torch.int64
    assert weights["t2d"].dtype == torch.bool and weights["t2d"].sum() == 512
    assert "embed_tokens.weight" not in weights  # vLLM shares the verifier's
    card = (tmp_path / "out" / "README.md").read_text()
    assert "base_model: " + str(tiny_llama_dir.resolve()) in card and "ttt_steps | 4" in card


def test_sglang_config_fields(tmp_path, llama_checkpoint, tiny_llama_dir):
    export(llama_checkpoint, out=tmp_path / "out", format="eagle3-sglang", verifier_name=str(tiny_llama_dir))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["draft_vocab_size"] == 512 and cfg["vocab_size"] == 49152 and cfg["num_hidden_layers"] == 1
    assert cfg["tie_word_embeddings"] is False
    # SGLang captures the input of layer id + 1: our ids (input of layer i) are written minus one.
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "midlayer.self_attn.q_proj.weight" in weights and "midlayer.hidden_norm.weight" in weights
    assert not any(k.startswith("layers.") for k in weights)


def test_defaults_from_checkpoint(tmp_path, llama_checkpoint, tiny_llama_dir):
    # A train output folder resolves to best/; speculative_tokens follow the training's TTT steps;
    # the recorded verifier is kept when none is given.
    run = tmp_path / "run"
    shutil.copytree(llama_checkpoint, run / "best")
    summary = export(run, out=tmp_path / "out")
    assert summary["source"].endswith("best") and summary["speculative_tokens"] == 4
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(tiny_llama_dir)


def test_embedded_verifier_name_maps_to_hub_id(tmp_path, smollm2_dir):
    ckpt = make_checkpoint(tmp_path / "ckpt", smollm2_dir, aux_layer_ids=(2, 15, 27), draft_vocab=256)
    summary = export(ckpt, out=tmp_path / "out", verifier_name="smollm2-135m")
    assert summary["verifier"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_safeailab_checkpoint_import(tmp_path, llama_checkpoint, tiny_llama_dir):
    """An upstream-style EAGLE-3 folder: pytorch_model.bin, midlayer.* names, no embeddings, SafeAILab config."""
    original, _ = load_draft(llama_checkpoint)
    state = {("midlayer." + k.removeprefix("layers.0.")) if k.startswith("layers.0.") else k: v
             for k, v in original.state_dict().items() if k != "embed_tokens.weight"}
    folder = tmp_path / "upstream"
    folder.mkdir()
    torch.save(state, folder / "pytorch_model.bin")
    kw = original.kwargs
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "bias": False, "draft_vocab_size": 512, "hidden_act": "silu",
        "hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 512, "model_type": "llama",
        "num_attention_heads": 2, "num_hidden_layers": 1, "num_key_value_heads": 1, "head_dim": 32,
        "rms_norm_eps": kw["rms_norm_eps"], "rope_theta": kw["rope_parameters"]["rope_theta"], "rope_scaling": None,
        "tie_word_embeddings": False, "torch_dtype": "float32", "vocab_size": 49152}))
    with pytest.raises(UserError, match="no embed_tokens.weight.*pass the verifier"):
        import_draft(folder)
    imported, config = import_draft(folder, verifier=str(tiny_llama_dir))
    assert_same_draft(original, imported)
    assert config["aux_layer_ids"] == [2, 4, 5]  # SGLang's default for an 8-layer verifier, in our convention
    # ... and it converts to the speculators format.
    export(folder, out=tmp_path / "spec", verifier_name=str(tiny_llama_dir))
    again, _ = import_draft(tmp_path / "spec")
    assert_same_draft(original, again)


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hi")
    with pytest.raises(UserError, match="is not a draft checkpoint"):
        export(tmp_path / "junk", out=tmp_path / "out")
    with pytest.raises(UserError, match="does not exist"):
        export(tmp_path / "missing", out=tmp_path / "out")
    (tmp_path / "hf").mkdir()
    hf_config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(UserError, match="is not a draft config"):
        import_draft(tmp_path / "hf")


@pytest.mark.parametrize(("path", "message"), [
    (("speculators_config", "verifier"), "speculators_config.verifier.name_or_path"),
    (("speculators_config", "proposal_methods"), "proposal_methods"),
    (("transformer_layer_config",), "transformer_layer_config"),
    (("draft_vocab_size",), "draft_vocab_size"),
])
def test_speculators_missing_fields(tmp_path, llama_checkpoint, tiny_llama_dir, path, message):
    export(llama_checkpoint, out=tmp_path / "out", verifier_name=str(tiny_llama_dir))
    cfg_path = tmp_path / "out" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    node = cfg
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=message):
        import_draft(tmp_path / "out", verifier=str(tiny_llama_dir))


def test_weights_that_do_not_match_the_config(tmp_path, llama_checkpoint, tiny_llama_dir):
    export(llama_checkpoint, out=tmp_path / "out", verifier_name=str(tiny_llama_dir))
    from safetensors.torch import save_file

    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    del weights["layers.0.hidden_norm.weight"]
    save_file(weights, str(tmp_path / "out" / "model.safetensors"))
    with pytest.raises(UserError, match=r"missing \['layers.0.hidden_norm.weight'\]"):
        import_draft(tmp_path / "out")


def test_verifier_mismatch(tmp_path, llama_checkpoint, smollm2_dir, tiny_llama_dir):
    with pytest.raises(UserError, match="hidden size 576 but the draft was built for verifier hidden size 64"):
        export(llama_checkpoint, out=tmp_path / "out", verifier_name=str(smollm2_dir))
    other = tmp_path / "other-vocab"
    other.mkdir()
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    cfg["vocab_size"] = 32000
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="vocab size 32000 but the draft's embeddings and t2d cover 49152"):
        export(llama_checkpoint, out=tmp_path / "out", verifier_name=str(other))
    with pytest.raises(UserError, match="vocab size 32000"):
        import_draft(llama_checkpoint, verifier=str(other))
    assert not (tmp_path / "out" / "config.json").exists()


def test_model_card_quotes_evaluation(tmp_path, llama_checkpoint, tiny_llama_dir):
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"acceptance_length": 2.4567, "per_position": [0.6, 0.4, 0.2], "k": 3}))
    export(llama_checkpoint, out=tmp_path / "out", verifier_name=str(tiny_llama_dir), eval_results=results)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "| acceptance_length | 2.457 |" in card and "| per_position | 0.6, 0.4, 0.2 |" in card


def test_cli_export(tmp_path, llama_checkpoint, tiny_llama_dir):
    from tiny_speculators.cli import main

    code = main(["export", str(llama_checkpoint), "--out", str(tmp_path / "out"), "--format", "eagle3-sglang",
                 "--verifier-name", str(tiny_llama_dir)])
    assert code in (0, None)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["format"] == "eagle3-sglang"
