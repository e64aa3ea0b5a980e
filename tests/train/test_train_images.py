"""Training on image chats (tiny random Qwen2.5-VL and Qwen3-VL): online in this process, the verifier's states
and the draft's positions in a batch equal what offline training reads from extract's shards; sources that cannot
feed images refuse them in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiny_speculators.data.prepare import prepare
from tiny_speculators.errors import UserError
from tiny_speculators.train.sources import OfflineSource, OnlineSource, PreparedTokens
from tiny_speculators.verifier.extract import extract
from tiny_speculators.verifier.load import load_verifier
from tiny_vl import write_image_chats


@pytest.fixture(scope="module")
def image_extraction(tiny_vl_dir, tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("train-images")
    data, _ = write_image_chats(folder)
    prepare(str(tiny_vl_dir), [data], folder / "prepared")
    summary = extract(data=folder / "prepared", out=folder / "extract", dtype="float32", device="cpu",
                      progress=False)
    return folder / "prepared", folder / "extract", summary["aux_layer_ids"]


@pytest.mark.parametrize("pack", [False, True])
def test_online_batches_equal_offline_ones(image_extraction, tiny_vl_dir, pack):
    prepared, extraction, aux_ids = image_extraction
    model, _ = load_verifier(tiny_vl_dir, with_tokenizer=False)
    online = OnlineSource(prepared, model, aux_ids, None, str(tiny_vl_dir))
    offline = OfflineSource(extraction)
    rows = [0, 1, 2, 3]  # two images, one, one, none: batched together
    a, b = offline.batch(rows, torch.device("cpu"), pack), online.batch(rows, torch.device("cpu"), pack)
    assert a.keys() == b.keys()
    real = a["attention_mask"].bool()
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["position_ids"][real], b["position_ids"][real])
    if not pack:  # an image takes fewer positions than tokens (packed, positions restart per sample anyway)
        assert not torch.equal(a["position_ids"][real], torch.cat([torch.arange(n) for n in real.sum(-1).tolist()]))
    for key in ("aux_hidden_states", "last_hidden_state"):
        torch.testing.assert_close(a[key][real], b[key][real], atol=2e-5, rtol=0)


def test_sources_that_cannot_feed_images_refuse_them(image_extraction, tiny_vl_dir):
    prepared, _, aux_ids = image_extraction
    with pytest.raises(UserError, match=r"holds images: train it offline .* or online in this process"):
        PreparedTokens(prepared, None)  # the vLLM producers' token side
    model, _ = load_verifier(tiny_vl_dir, with_tokenizer=False)
    with pytest.raises(UserError, match=r"holds images: --max-length would cut through them"):
        OnlineSource(prepared, model, aux_ids, 16, str(tiny_vl_dir))
