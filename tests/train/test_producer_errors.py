"""``train --producer vllm`` without vLLM: no Mooncake master answering, and producer options without their mode,
are one-line errors (the proofs with the real engines are in test_producer_source.py)."""

from __future__ import annotations

import pytest
from producer_inputs import ProducerInputs, dead_url, producer_inputs

from tiny_speculators.cli import main
from tiny_speculators.errors import UserError
from tiny_speculators.serving import free_port
from tiny_speculators.train.stage import train


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> ProducerInputs:
    return producer_inputs(tmp_path_factory.mktemp("producer-inputs"))


def test_no_master_is_a_one_line_error(inputs, tmp_path, capsys):
    master = f"127.0.0.1:{free_port()}"
    rc = main(["train", "--verifier", "smollm2-135m", "--data", str(inputs.prepared), "--online", "--producer", "vllm",
               "--producer-urls", dead_url(), "--mooncake-master", master, "--vocab", str(inputs.vocab), "--out",
               str(tmp_path / "o")])
    assert rc == 1
    assert capsys.readouterr().err == (f"tiny-speculators train: error: no Mooncake master answers at {master} "
                                       "(Connection refused): start mooncake_master there, or leave --mooncake-master "
                                       "unset to have the trainer start one on 127.0.0.1\n")


def test_producer_options_need_their_mode(inputs, tmp_path):
    common = dict(verifier="smollm2-135m", vocab=inputs.vocab, out=tmp_path / "o")
    with pytest.raises(UserError, match="--producer vllm is a way of online training"):
        train(**common, hidden_states=tmp_path, producer="vllm")
    with pytest.raises(UserError, match="--producer-urls / --mooncake-master are for --producer vllm"):
        train(**common, data=inputs.prepared, online=True, mooncake_master="127.0.0.1:50051")
    with pytest.raises(UserError, match="--producer-urls needs --mooncake-master"):
        train(**common, data=inputs.prepared, online=True, producer="vllm", producer_urls=[dead_url()])
