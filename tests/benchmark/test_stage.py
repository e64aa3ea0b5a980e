"""Bad input to ``tiny-speculators benchmark`` fails in one line, before any server starts.

    pytest -q tests/benchmark/test_stage.py
"""

from __future__ import annotations

import json
import socket

import pytest

from tiny_speculators import cli
from tiny_speculators.benchmark.stage import benchmark, read_draft, serving_verifier
from tiny_speculators.errors import UserError
from tiny_speculators.serving import free_port


def _one_line_error(capsys, argv: list[str]) -> str:
    assert cli.main(["benchmark", *argv]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("tiny-speculators benchmark: error: ") and "\n" not in err, err
    return err


def test_endpoint_that_does_not_answer(capsys, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    err = _one_line_error(capsys, ["--endpoint", url, "--out", str(tmp_path / "out")])
    assert f"--endpoint: {url}/v1/models does not answer" in err
    assert not (tmp_path / "out").exists()


def test_port_in_use(capsys, tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        err = _one_line_error(capsys, ["--draft", str(tmp_path), "--port", str(port), "--out", str(tmp_path / "o")])
    assert f"port {port} on 127.0.0.1 is in use" in err


def test_options_are_checked(tmp_path):
    with pytest.raises(UserError, match="pass --draft .* or --endpoint"):
        benchmark(out=tmp_path)
    with pytest.raises(UserError, match="--concurrency needs values of at least 1"):
        benchmark(tmp_path, out=tmp_path, concurrency=(0, 2))
    with pytest.raises(UserError, match="--requests must be at least 1"):
        benchmark(tmp_path, out=tmp_path, requests=0)
    with pytest.raises(UserError, match="--baseline-endpoint needs --endpoint"):
        benchmark(tmp_path, out=tmp_path, baseline_endpoint="http://127.0.0.1:1")


def test_draft_must_be_an_export(tmp_path):
    with pytest.raises(UserError, match="no config.json there"):
        read_draft(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UserError, match="not in a format vLLM serves"):
        read_draft(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({
        "speculators_model_type": "eagle3",
        "speculators_config": {"algorithm": "eagle3", "proposal_methods": [{"speculative_tokens": 3}],
                               "verifier": {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}}}))
    info = read_draft(tmp_path)
    assert {k: info[k] for k in ("method", "k", "verifier")} == {
        "method": "eagle3", "k": 3, "verifier": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    assert info["spec"](5) == {"model": str(tmp_path.resolve()), "num_speculative_tokens": 5, "method": "eagle3"}
    # a P-EAGLE export is served as eagle3 + parallel_drafting (vLLM rejects the method name "peagle")
    (tmp_path / "config.json").write_text(json.dumps({
        "speculators_model_type": "peagle", "mask_token_id": 0,
        "speculators_config": {"algorithm": "peagle", "proposal_methods": [{"speculative_tokens": 4}],
                               "verifier": {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}}}))
    info = read_draft(tmp_path)
    assert info["method"] == "eagle3" and info["k"] == 4
    assert info["spec"](4)["parallel_drafting"] is True
    # a stitched MTP export is the verifier itself: vLLM serves the folder with method mtp; k from summary.json
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MiMoForCausalLM"],
                                                      "num_nextn_predict_layers": 1}))
    (tmp_path / "summary.json").write_text(json.dumps({"speculative_tokens": 2}))
    info = read_draft(tmp_path)
    assert {k: info[k] for k in ("method", "k", "verifier")} == {"method": "mtp", "k": 2,
                                                                 "verifier": str(tmp_path.resolve())}
    assert info["spec"](3) == {"method": "mtp", "num_speculative_tokens": 3}


def test_serving_verifier(tmp_path):
    with pytest.raises(UserError, match="the draft records no verifier: pass --verifier"):
        serving_verifier(None, None)
    assert serving_verifier("Qwen/Qwen3-8B", None) == "Qwen/Qwen3-8B"  # a hub id goes to vLLM as it is
    (tmp_path / "config.json").write_text("{}")
    assert serving_verifier(None, str(tmp_path)) == str(tmp_path)
