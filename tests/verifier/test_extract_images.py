"""The HF extraction of image chats (tiny random Qwen2.5-VL and Qwen3-VL): the stored states are the verifier's own
with its images (the processor's pixels, the model's M-RoPE positions), checked against the whole model run on what
the processor's ``apply_chat_template`` gives, in fp32; Qwen3-VL's DeepStack features are in the aux states as vLLM
captures them (a layer's input); what the extraction cannot do with images fails in one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from extract_checks import assert_close
from tiny_speculators.data.layouts import normalize_record
from tiny_speculators.data.prepare import prepare
from tiny_speculators.errors import UserError
from tiny_speculators.storage.reader import HiddenStateReader
from tiny_speculators.verifier.extract import extract
from tiny_speculators.verifier.load import load_verifier
from tiny_speculators.verifier.modules import find_parts
from tiny_speculators.verifier.vision import Vision
from tiny_vl import make_image, write_image_chats

SMALL = dict(dtype="float32", device="cpu", progress=False)


@pytest.fixture(scope="module")
def image_data(tiny_vl_dir, tmp_path_factory):
    """The four chats of ``write_image_chats`` prepared for the tiny verifier: (folder, chats file, records)."""
    folder = tmp_path_factory.mktemp("image-data")
    data, records = write_image_chats(folder)
    prepare(str(tiny_vl_dir), [data], folder / "prepared")
    return folder, data, records


def _processor_inputs(processor, record: dict, folder: Path) -> dict[str, torch.Tensor]:
    messages, _ = normalize_record(record)
    for m in messages:
        for part in m["content"] if isinstance(m["content"], list) else []:
            if part["type"] == "image" and not part["image"].startswith("data:"):
                ref = part["image"].removeprefix("file://")
                part["image"] = ref if Path(ref).is_absolute() else str(folder / ref)
    return processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt",
                                         processor_kwargs={"return_mm_token_type_ids": True})


def _reference_aux(model, inputs: dict[str, torch.Tensor], layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs of ``layer_ids`` and the logits from the whole model's own forward: ``hidden_states[i]``, plus for
    Qwen3-VL the DeepStack features of the images that the model adds to the output of layer i - 1 (i - 1 < n)
    before layer i reads it (HF records the output before the addition; vLLM's aux states come after it)."""
    with torch.inference_mode():
        out = model(**inputs, output_hidden_states=True)
        states = [out.hidden_states[i][0].clone() for i in layer_ids]
        if "pixel_values" in inputs and getattr(model.config.vision_config, "deepstack_visual_indexes", None):
            features = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"],
                                                      return_dict=True).deepstack_features
            image = inputs["mm_token_type_ids"][0] == 1
            for state, i in zip(states, layer_ids, strict=True):
                if 0 < i <= len(features):
                    state[image] += torch.cat(list(features[i - 1]) if isinstance(features[i - 1], (list, tuple))
                                              else [features[i - 1]])
    return torch.cat(states, -1), out.logits[0]


def test_stored_states_are_the_verifiers_own_with_its_images(image_data, tiny_vl_dir, tmp_path):
    folder, _, records = image_data
    # 160 tokens a batch: the two-image chat alone, the others together (rows with and without images mixed)
    summary = extract(data=folder / "prepared", out=tmp_path / "out", max_tokens_per_batch=160, **SMALL)
    deepstack = "qwen3" in tiny_vl_dir.name
    assert summary["aux_layer_ids"] == ([3, 4, 5] if deepstack else [2, 4, 5])
    assert summary["guard_agreed"] == summary["guard_positions"] > 0
    model, _ = load_verifier(tiny_vl_dir, with_tokenizer=False)
    parts, processor = find_parts(model), Vision.load(tiny_vl_dir).processor
    reader = HiddenStateReader(tmp_path / "out")
    assert len(reader) == len(records)
    for i, record in enumerate(records):
        inputs = _processor_inputs(processor, record, folder)
        got = reader[i]
        assert got["input_ids"].tolist() == inputs["input_ids"][0].tolist()
        # the draft's positions: the temporal row of the model's own M-RoPE positions
        rope, _ = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                             image_grid_thw=inputs.get("image_grid_thw"))
        assert got["position_ids"].tolist() == rope[0, 0].tolist()
        n = len(got["position_ids"])
        assert (got["position_ids"][-1] < n - 1) == ("pixel_values" in inputs)  # an image takes fewer positions
        aux, logits = _reference_aux(model, inputs, summary["aux_layer_ids"])
        assert_close(got["aux_hidden_states"], aux)
        with torch.inference_mode():
            assert_close(parts.lm_head(parts.norm(got["last_hidden_state"])), logits)
            if "pixel_values" in inputs:  # the images change the states: a run without them would be wrong
                blind = model(input_ids=inputs["input_ids"]).logits[0]
                assert (blind - logits).abs().max() > 0.1


def test_what_extraction_cannot_do_with_images_is_one_line(image_data, tiny_vl_dir, tmp_path):
    folder, data, _ = image_data
    prepared = folder / "prepared"
    with pytest.raises(UserError, match=r"holds images: extract --backend vllm does not feed images yet"):
        extract(data=prepared, out=tmp_path / "vllm", backend="vllm", **SMALL)
    with pytest.raises(UserError, match=r"holds images: --reuse matches token ids only"):
        extract(data=prepared, out=tmp_path / "reuse", reuse=tmp_path / "earlier", **SMALL)
    # an image replaced by one of another size after prepare: its grid no longer matches the prepared tokens
    moved = tmp_path / "moved"
    moved.mkdir()
    make_image(moved / "img" / "small.png")
    make_image(moved / "img" / "wide.png", (56, 56), 1)
    (moved / "chats.jsonl").write_text(data.read_text())
    prepare(str(tiny_vl_dir), [moved / "chats.jsonl"], moved / "prepared")
    make_image(moved / "img" / "wide.png", (112, 112), 1)
    with pytest.raises(UserError) as e:
        extract(data=moved / "prepared", out=tmp_path / "changed", **SMALL)
    message = str(e.value)
    assert "\n" not in message and "wide.png: its grid is now [1, 8, 8], prepared as [1, 4, 4]" in message
    # the sample that holds it (chats 1 and 3 both show wide.png; batches run longest first)
    assert re.search(r"sample \S+chats\.jsonl:[13]: image ", message) and "prepare the data again" in message


def test_the_pipeline_extracts_the_layers_extract_would_choose(image_data, tiny_vl_dir, tmp_path):
    """A pipeline names extract's layers from train's family default: past DeepStack for Qwen3-VL too."""
    from tiny_speculators.pipeline import plan_pipeline

    _, data, _ = image_data
    raw = {"run_dir": str(tmp_path / "run"), "verifier": str(tiny_vl_dir), "prepare": {"data": [str(data)]},
           "vocab": {}, "extract": {}, "train": {}, "export": {}, "evaluate": {}}
    layers = plan_pipeline(raw).stages["extract"].kwargs["layers"]
    assert layers == ([3, 4, 5] if "qwen3" in tiny_vl_dir.name else [2, 4, 5])
