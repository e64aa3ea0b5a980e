"""Images in chat data, for vision-language verifiers (tiny random Qwen2.5-VL and Qwen3-VL, ``tests/tiny_vl.py``):
every layout is read, placeholders expand exactly as the verifier's processor expands them, the loss falls on
assistant text only, pixels stay out of the prepared data, and a bad image drops its record in one line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tiny_speculators.data.chat import RecordError
from tiny_speculators.data.layouts import image_refs, normalize_record
from tiny_speculators.data.prepare import prepare
from tiny_speculators.data.prepared import load_prepared
from tiny_speculators.errors import UserError
from tiny_speculators.verifier.vision import Vision, open_image
from tiny_vl import IMAGE_PAD, make_image, write_image_chats


def _user(*parts):
    return {"role": "user", "content": list(parts)}


def _text(text):
    return {"type": "text", "text": text}


def test_layouts_keep_image_parts_in_order():
    record = {"messages": [
        _user({"type": "image_url", "image_url": {"url": "file:///a.png"}}, _text("and"),
              {"type": "image", "image": "b.png"}, {"type": "image_url", "image_url": "data:image/png;base64,AA=="}),
        {"role": "assistant", "content": "ok"}]}
    messages, _ = normalize_record(record)
    assert messages[0]["content"] == [{"type": "image", "image": "file:///a.png"}, _text("and"),
                                      {"type": "image", "image": "b.png"},
                                      {"type": "image", "image": "data:image/png;base64,AA=="}]
    assert image_refs(messages) == ["file:///a.png", "b.png", "data:image/png;base64,AA=="]
    # text-only content parts still read as a string
    plain, _ = normalize_record({"messages": [_user(_text("hi")), {"role": "assistant", "content": "yo"}]})
    assert plain[0]["content"] == "hi" and image_refs(plain) == []


def test_llava_markers_place_the_records_images():
    turns = [{"from": "human", "value": "<image>\nWhat is this? And <image>?"}, {"from": "gpt", "value": "Cats."}]
    messages, _ = normalize_record({"images": ["a.png", "b.png"], "conversations": turns})
    assert messages[0]["content"] == [{"type": "image", "image": "a.png"}, _text("\nWhat is this? And "),
                                      {"type": "image", "image": "b.png"}, _text("?")]
    # one "image" and no marker: before the first user turn's text
    messages, _ = normalize_record({"image": "c.png", "conversations": [{"from": "human", "value": "Describe."},
                                                                         {"from": "gpt", "value": "Red."}]})
    assert messages[0]["content"] == [{"type": "image", "image": "c.png"}, _text("Describe.")]


@pytest.mark.parametrize(("record", "reason"), [
    ({"messages": [_user(_text("hi")), {"role": "assistant", "content": [{"type": "image", "image": "a.png"}]}]},
     "image in an assistant turn"),
    ({"messages": [_user({"type": "image", "image": "a.png"}, {"type": "input_audio", "data": "x"}),
                   {"role": "assistant", "content": "ok"}]}, "unsupported content"),
    ({"images": ["a.png"], "conversations": [{"from": "human", "value": "<image><image>?"},
                                             {"from": "gpt", "value": "x"}]}, "image mismatch"),
    ({"image": "a.png", "messages": [_user({"type": "image", "image": "b.png"}),
                                     {"role": "assistant", "content": "x"}]}, "image mismatch"),
    ({"messages": [_user({"type": "image_url", "image_url": {"url": ""}}), {"role": "assistant", "content": "x"}]},
     "invalid image"),
    ({"images": [3], "conversations": [{"from": "human", "value": "?"}, {"from": "gpt", "value": "x"}]},
     "invalid image"),
])
def test_unsupported_image_layouts_name_the_reason(record, reason):
    with pytest.raises(RecordError) as e:
        normalize_record(record)
    assert e.value.reason == reason


def _processor_messages(record: dict, folder: Path) -> list[dict]:
    """``record``'s turns as the processor's chat template takes them, images as absolute paths."""
    messages, _ = normalize_record(record)
    for m in messages:
        if isinstance(m["content"], list):
            for part in m["content"]:
                if part["type"] == "image" and not part["image"].startswith("data:"):
                    ref = part["image"].removeprefix("file://")
                    part["image"] = str(ref if Path(ref).is_absolute() else folder / ref)
    return messages


def test_prepared_ids_are_the_processors_own(tmp_path, tiny_vl_dir, caplog):
    data, records = write_image_chats(tmp_path)
    caplog.set_level(logging.INFO)
    summary = prepare(str(tiny_vl_dir), [data], tmp_path / "out")
    assert summary["kept"] == 4 and summary["dropped"] == {} and summary["images"] == 4
    prepared = load_prepared(tmp_path / "out")
    vision = Vision.load(tiny_vl_dir)
    processor, pad = vision.processor, vision.image_token_id
    assert vision.image_token == IMAGE_PAD
    # the whole chat through the processor (its template, its image loading, its expansion): the same ids
    for row, record in zip(prepared.dataset, records, strict=True):
        expected = processor.apply_chat_template(_processor_messages(record, tmp_path), tokenize=True,
                                                 return_dict=True)
        assert row["input_ids"] == list(expected["input_ids"][0])
        grids = expected.get("image_grid_thw")
        assert row["image_grid_thw"] == ([[int(v) for v in g] for g in grids] if grids is not None else [])
    ids, refs = prepared.dataset["input_ids"], prepared.dataset["images"]
    # 56x56: 4 tokens (grid 1x4x4), 112x56: 8 tokens (grid 1x4x8); loss on assistant text only
    assert [row.count(pad) for row in ids] == [12, 4, 8, 0]
    assert prepared.dataset["image_grid_thw"][0] == [[1, 4, 4], [1, 4, 8]]
    tok = processor.tokenizer
    for row, mask in zip(ids, prepared.dataset["loss_mask"], strict=True):
        assert not any(m for t, m in zip(row, mask, strict=True) if t == pad)
    masked = tok.decode([t for t, m in zip(ids[0], prepared.dataset["loss_mask"][0], strict=True) if m])
    assert masked == "Noise.<|im_end|>Wider noise.<|im_end|>"  # the assistant turns and their end tokens
    # references, not pixels: files by absolute path, the inline image once under the prepared folder
    assert refs[0] == [str((tmp_path / "img" / "small.png").resolve()), str((tmp_path / "img" / "wide.png").resolve())]
    assert refs[3] == [] and refs[1][0].startswith("images/") and refs[1][0].endswith(".png")
    assert [p.name for p in (tmp_path / "out" / "images").iterdir()] == [refs[1][0].split("/")[1]]
    assert open_image(refs[1][0], tmp_path / "out").tobytes() == open_image(refs[0][0]).tobytes()
    assert not any(p.suffix == ".png" for p in (tmp_path / "out" / "dataset").rglob("*"))


def test_a_bad_image_drops_its_record_in_one_line(tmp_path, tiny_vl_dir, caplog):
    data, _ = write_image_chats(tmp_path)
    corrupt = tmp_path / "img" / "corrupt.png"
    corrupt.write_bytes((tmp_path / "img" / "small.png").read_bytes()[:60])
    lines = data.read_text().splitlines()
    for name in ("missing.png", "corrupt.png"):
        lines.append(json.dumps({"image": f"img/{name}", "conversations": [{"from": "human", "value": "Hm?"},
                                                                          {"from": "gpt", "value": "Hm."}]}))
    data.write_text("\n".join(lines) + "\n")
    caplog.set_level(logging.WARNING)
    summary = prepare(str(tiny_vl_dir), [data], tmp_path / "out")
    assert summary["kept"] == 4 and summary["dropped"] == {"bad image": 2}
    warnings = [r.getMessage() for r in caplog.records if "bad image" in r.getMessage()]
    assert len(warnings) == 2 and all("\n" not in w for w in warnings)
    assert f"{data}:5" in warnings[0] and "img/missing.png: no such file" in warnings[0]
    assert f"{data}:6" in warnings[1] and "not a readable image" in warnings[1] and "corrupt.png" in warnings[1]
    with pytest.raises(UserError, match=rf"{data}:5: bad image.*--strict"):
        prepare(str(tiny_vl_dir), [data], tmp_path / "strict", strict=True)
    assert not (tmp_path / "strict").exists()


def test_truncation_never_cuts_through_an_image(tmp_path, tiny_vl_dir):
    make_image(tmp_path / "a.png")
    record = {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello there."},
                           _user(_text("Look:"), {"type": "image", "image": "a.png"}, _text("Well?")),
                           {"role": "assistant", "content": "It is a square of random noise."}]}
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps(record) + "\n")
    prepare(str(tiny_vl_dir), [data], tmp_path / "full")
    ids = load_prepared(tmp_path / "full").dataset["input_ids"][0]
    pad = Vision.load(tiny_vl_dir).image_token_id
    first = ids.index(pad)
    assert ids[first:first + 5] == [pad] * 4 + [ids[first + 4]] and ids[first + 4] != pad
    # a limit inside the image's four tokens ends the sample before the image: no part of it, no reference
    summary = prepare(str(tiny_vl_dir), [data], tmp_path / "cut", max_length=first + 2)
    cut = load_prepared(tmp_path / "cut").dataset
    assert summary["truncated"] == 1 and summary["images"] == 0
    assert cut["input_ids"][0] == ids[:first] and cut["images"][0] == [] and cut["image_grid_thw"][0] == []
    # a limit after the image keeps it whole, with its reference and grid
    summary = prepare(str(tiny_vl_dir), [data], tmp_path / "after", max_length=len(ids) - 2)
    after = load_prepared(tmp_path / "after").dataset
    assert summary["truncated"] == 1 and after["input_ids"][0] == ids[:-2]
    assert len(after["images"][0]) == 1 and after["image_grid_thw"][0] == [[1, 4, 4]]


def test_images_for_a_text_only_verifier_are_reported(tmp_path, smollm2_dir):
    make_image(tmp_path / "a.png")
    data = tmp_path / "one.jsonl"
    text = {"conversations": [{"from": "human", "value": "?"}, {"from": "gpt", "value": "!"}]}
    data.write_text(json.dumps({"image": "a.png", **text}) + "\n" + json.dumps(text) + "\n")
    summary = prepare(str(smollm2_dir), [data], tmp_path / "out")
    assert summary["kept"] == 1 and summary["dropped"] == {"images for a text-only verifier": 1}
    assert "images" not in load_prepared(tmp_path / "out").dataset.column_names
    with pytest.raises(UserError, match=rf"{data}:1: images for a text-only verifier: 1 image\(s\), but the "
                                        "verifier has no image processor"):
        prepare(str(smollm2_dir), [data], tmp_path / "strict", strict=True)


def test_regenerate_refuses_image_chats_in_one_line(tmp_path):
    """Its answers would come without the images: refused before anything runs (prepare reads them as they are)."""
    from tiny_speculators.data.regenerate import read_conversations

    data, _ = write_image_chats(tmp_path)
    with pytest.raises(UserError, match=rf"^{data}:1: the chat holds images, and regenerate does not feed images"):
        read_conversations([data])
