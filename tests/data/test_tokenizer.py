"""A tokenizer-only verifier folder (no config.json) is enough for prepare and vocab; stages that run
the model say in one line that they need it."""

from __future__ import annotations

import json
import logging

import pytest

from tiny_speculators import cli
from tiny_speculators.data.prepare import prepare
from tiny_speculators.data.tokenizer import load_prepare_tokenizer, tokenizer_only_folder
from tiny_speculators.data.vocab import load_vocab, vocab
from tiny_speculators.errors import UserError


@pytest.fixture(scope="module")
def tokenizer_only(tmp_path_factory, smollm2_dir):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tokenizer-only")
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(folder)
    assert not (folder / "config.json").exists() and not list(folder.glob("*.safetensors"))
    return folder


def test_prepare_and_vocab_on_a_tokenizer_only_folder(tmp_path, tokenizer_only, smollm2_dir, caplog):
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "2+2?"},
                                              {"role": "assistant", "content": "4, of course."}]}) + "\n")
    caplog.set_level(logging.WARNING)
    summary = prepare(str(tokenizer_only), [chats], tmp_path / "prepared")
    assert summary["kept"] == 1 and summary["model_vocab_size"] is None
    assert "--target-vocab-size" in caplog.text
    # the same tokens as through the full model folder
    full = prepare(str(smollm2_dir), [chats], tmp_path / "prepared-full")
    assert full["model_vocab_size"] == 49152
    from tiny_speculators.data.prepared import load_prepared

    assert load_prepared(tmp_path / "prepared").dataset["input_ids"] == \
        load_prepared(tmp_path / "prepared-full").dataset["input_ids"]
    caplog.clear()
    info = vocab(tmp_path / "prepared", tmp_path / "vocab", size=8)
    d2t, t2d = load_vocab(tmp_path / "vocab")
    assert info["target_vocab_size"] == summary["vocab_size"] == t2d.numel() and d2t.numel() == 8
    assert "--target-vocab-size" in caplog.text
    caplog.clear()
    info = vocab(tmp_path / "prepared", tmp_path / "vocab-sized", size=8, target_vocab_size=49152)
    assert info["target_vocab_size"] == 49152 and "--target-vocab-size" not in caplog.text


def test_folders_that_are_neither(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds neither a model .config.json. nor a tokenizer"):
        load_prepare_tokenizer(tmp_path / "empty")
    assert tokenizer_only_folder("smollm2-135m") is None and tokenizer_only_folder(tmp_path / "absent") is None


@pytest.mark.parametrize("stage", ["extract", "regenerate"])
def test_stages_that_need_the_model_say_so_in_one_line(tmp_path, tokenizer_only, stage, capsys):
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "hello"}]}) + "\n")
    data = chats
    if stage == "extract":
        data = tmp_path / "prepared"
        prepare(str(tokenizer_only), [chats], data)
        capsys.readouterr()
    code = cli.main([stage, "--verifier", str(tokenizer_only), "--data", str(data), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1, err
    assert f"verifier folder {tokenizer_only} has no config.json" in err and "needs the model" in err, err
