"""The evaluate stage end to end: CLI, results.json / summary.json / plot, imported (exported) drafts,
prompt files and clear errors."""

from __future__ import annotations

import json

import pytest
from eval_helpers import save_random_checkpoint

from tiny_speculators.cli import main
from tiny_speculators.errors import UserError
from tiny_speculators.evaluate.prompts import load_prompts
from tiny_speculators.evaluate.stage import evaluate


@pytest.fixture(scope="module")
def random_checkpoint(tiny_llama_dir, tmp_path_factory):
    return save_random_checkpoint(tiny_llama_dir, tmp_path_factory.mktemp("random-draft"))


def test_cli_writes_results_summary_and_plot(tiny_llama_dir, random_checkpoint, tmp_path):
    out = tmp_path / "eval"
    rc = main(["evaluate", "--verifier", str(tiny_llama_dir), "--draft", str(random_checkpoint), "--prompts",
               "builtin", "--out", str(out), "--max-prompts", "3", "--max-new-tokens", "8", "--k", "3"])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert (out / "acceptance.png").stat().st_size > 1000
    assert [p["id"] for p in results["per_prompt"]] == ["chat-00", "code-00", "math-00"]
    assert results["matches_baseline"] is True and summary["matches_baseline"] is True
    assert results["acceptance_length"] == pytest.approx(1.0, abs=0.2)  # random draft
    assert len(results["per_position_acceptance"]) == 3
    assert results["num_draft_tokens"] == 3 * results["num_drafts"]
    assert results["speedup"] > 0 and results["tokens_per_second"] > 0
    for p in results["per_prompt"]:
        assert 1 <= len(p["tokens"]) <= 8 and isinstance(p["text"], str) and p["matches_baseline"]
        assert p["acceptance_length"] == 1 + p["num_accepted_tokens"] / p["num_drafts"]


def test_exported_draft_evaluates_like_the_checkpoint(tiny_llama_dir, random_checkpoint, tmp_path):
    """A speculators-format export of the draft (what vLLM loads) gives the same tokens and acceptance."""
    from tiny_speculators.export.stage import export

    export(random_checkpoint, out=tmp_path / "exported", speculative_tokens=3)
    common = dict(prompts="math", max_prompts=2, max_new_tokens=6, baseline=False, tree=True, tree_depth=2,
                  tree_topk=2, tree_total_tokens=4)
    a = evaluate(str(tiny_llama_dir), random_checkpoint, tmp_path / "a", **common)
    b = evaluate(str(tiny_llama_dir), tmp_path / "exported", tmp_path / "b", **common)
    assert b["draft_format"] == "speculators"
    ra = json.loads((tmp_path / "a" / "results.json").read_text())
    rb = json.loads((tmp_path / "b" / "results.json").read_text())
    assert [p["tokens"] for p in ra["per_prompt"]] == [p["tokens"] for p in rb["per_prompt"]]
    assert a["acceptance_length"] == b["acceptance_length"] and a["speedup"] is None


def test_sampling_run_is_reproducible(tiny_llama_dir, random_checkpoint, tmp_path):
    kw = dict(prompts="chat", max_prompts=1, max_new_tokens=6, temperature=0.8, top_p=0.9, top_k=50, seed=7,
              baseline=False)
    evaluate(str(tiny_llama_dir), random_checkpoint, tmp_path / "a", **kw)
    evaluate(str(tiny_llama_dir), random_checkpoint, tmp_path / "b", **kw)
    tokens = [json.loads((tmp_path / x / "results.json").read_text())["per_prompt"][0]["tokens"] for x in "ab"]
    assert tokens[0] == tokens[1]


def test_prompt_files_and_errors(tmp_path, tiny_llama_dir, random_checkpoint):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n\n{"id": "x", "messages": [{"role": "system", "content": "be brief"}, '
                 '{"role": "user", "content": "2+2?"}]}\n')
    prompts = load_prompts(str(f))
    assert [p.id for p in prompts] == ["p-1", "x"] and prompts[1].messages[0]["role"] == "system"
    assert len(load_prompts("builtin")) >= 36 and len(load_prompts("code,math", max_prompts=5)) == 5
    user = load_prompts("user")  # the second held-out set: by name, not in "builtin"
    assert len(user) >= 24 and not {p.id for p in user} & {p.id for p in load_prompts("builtin")}
    both = [p.id for p in load_prompts("builtin,user")]  # every set named, interleaved
    assert both[:4] == ["chat-00", "code-00", "math-00", "user-00"] and len(both) == len(load_prompts("builtin")) + 24
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"messages": [{"role": "assistant", "content": "x"}]}\n')
    with pytest.raises(UserError, match="bad.jsonl line 2"):
        load_prompts(str(bad))
    with pytest.raises(UserError, match="neither a file nor a built-in set"):
        load_prompts("poetry")
    with pytest.raises(UserError, match="does not exist"):
        evaluate(str(tiny_llama_dir), tmp_path / "missing", tmp_path / "o", prompts="chat", max_prompts=1)
    with pytest.raises(UserError, match="k must be"):
        evaluate(str(tiny_llama_dir), random_checkpoint, tmp_path / "o", k=0)
