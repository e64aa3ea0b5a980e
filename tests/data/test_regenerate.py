"""``regenerate``: the verifier's own answers, in-process or from an OpenAI-compatible server."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch

from tiny_speculators.cli import main
from tiny_speculators.data.regenerate import chat_completions_url, regenerate
from tiny_speculators.errors import UserError

RECORDS = [
    {"messages": [{"role": "user", "content": "Name a colour."}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]},
    {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "ORIGINAL ONE"},
                  {"role": "user", "content": "Tell me more"}, {"role": "assistant", "content": "ORIGINAL TWO"}]},
    {"conversations": [{"from": "human", "value": "Write a word."}, {"from": "gpt", "value": "ORIGINAL THREE"}]},
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def read_chats(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "chats.jsonl").read_text(encoding="utf-8").splitlines()]


def greedy_answer(model, tokenizer, messages, max_new_tokens: int) -> str:
    """The reference: one conversation, no padding, plain ``generate``."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    new = out[0, ids["input_ids"].shape[1]:].tolist()
    if tokenizer.eos_token_id in new:
        new = new[:new.index(tokenizer.eos_token_id)]
    return tokenizer.decode(new, skip_special_tokens=True).strip()


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_llama_dir)


def test_in_process_answers_equal_plain_greedy_generation(tmp_path, tiny_llama_dir, tiny):
    data = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    summary = regenerate(str(tiny_llama_dir), [data], tmp_path / "out", max_new_tokens=12, batch_size=3)
    chats = read_chats(tmp_path / "out")
    assert summary["kept"] == 4 and summary["dropped"] == {}
    assert summary["assistant_turns_generated"] == 5 and summary["new_tokens"] > 0
    assert [len(c["messages"]) for c in chats] == [2, 3, 4, 2]
    # non-assistant turns kept verbatim, originals never survive
    assert chats[1]["messages"][:2] == RECORDS[1]["messages"]
    assert chats[2]["messages"][0] == RECORDS[2]["messages"][0]
    assert chats[2]["messages"][2] == RECORDS[2]["messages"][2]
    assert not any("ORIGINAL" in m["content"] for c in chats for m in c["messages"])
    model, tokenizer = tiny
    for chat in chats:  # every answer = the verifier's greedy answer to the (regenerated) history before it
        for i, m in enumerate(chat["messages"]):
            if m["role"] == "assistant":
                assert m["content"] == greedy_answer(model, tokenizer, chat["messages"][:i], 12)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["kept"] == 4


def test_sampling_is_seeded(tmp_path, tiny_llama_dir):
    data = write_jsonl(tmp_path / "in.jsonl", RECORDS[:2])
    a = regenerate(str(tiny_llama_dir), [data], tmp_path / "a", max_new_tokens=8, temperature=1.0, seed=3)
    b = regenerate(str(tiny_llama_dir), [data], tmp_path / "b", max_new_tokens=8, temperature=1.0, seed=3)
    assert read_chats(tmp_path / "a") == read_chats(tmp_path / "b")
    assert a["temperature"] == 1.0 and a["seed"] == 3 and b["new_tokens"] == a["new_tokens"]


def test_extra_answers_are_sampled_records_next_to_the_first(tmp_path, tiny_llama_dir):
    """Each extra answer i is what a run sampling at extra_temperature with seed + i gives; the first answers are
    the greedy run's; every answer is its own record (id ``<id>~<i>``) after the record's first."""
    data = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    kw = dict(max_new_tokens=8, batch_size=3)
    summary = regenerate(str(tiny_llama_dir), [data], tmp_path / "both", extra_answers=2, extra_temperature=1.0,
                         seed=3, **kw)
    greedy = read_chats(regenerate_to(tiny_llama_dir, data, tmp_path / "greedy", **kw))
    sampled = [read_chats(regenerate_to(tiny_llama_dir, data, tmp_path / f"t{i}", temperature=1.0, seed=3 + i, **kw))
               for i in (1, 2)]
    chats = read_chats(tmp_path / "both")
    assert summary["kept"] == 12 and summary["extra_answers"] == 2 and summary["assistant_turns_generated"] == 15
    assert [c["id"] for c in chats] == [f"{g['id']}{s}" for g in greedy for s in ("", "~1", "~2")]
    assert [c["messages"] for c in chats[0::3]] == [g["messages"] for g in greedy]
    for i in (1, 2):
        assert [c["messages"] for c in chats[i::3]] == [s["messages"] for s in sampled[i - 1]]
    assert chats[1::3] != chats[0::3] and chats[1::3] != chats[2::3]  # sampled, and differently
    assert chats[7]["messages"][::2] == chats[6]["messages"][::2]  # user turns kept verbatim in every answer
    with pytest.raises(UserError, match="extra_temperature must be above 0"):
        regenerate(str(tiny_llama_dir), [data], tmp_path / "x", extra_answers=1, extra_temperature=0.0)


def regenerate_to(verifier, data: Path, out: Path, **kw) -> Path:
    regenerate(str(verifier), [data], out, **kw)
    return out


def test_resume_skips_finished_records_and_restarts_on_changed_settings(tmp_path, tiny_llama_dir):
    data = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    out = tmp_path / "out"
    finished = regenerate(str(tiny_llama_dir), [data], out, max_new_tokens=6, max_records=2)
    first = read_chats(out)
    assert sorted(p.name for p in out.iterdir()) == ["chats.jsonl", "summary.json"]  # no journal left behind
    assert all(c["new_tokens"] > 0 and c["truncated_turns"] >= 0 for c in first)
    # an interrupted run after it: a third record in its journal, then a torn write
    (out / "partial.settings.json").write_text(json.dumps(finished["generation_settings"]))
    regenerate(str(tiny_llama_dir), [data], tmp_path / "other", max_new_tokens=6, max_records=3)
    third = {**read_chats(tmp_path / "other")[2], "messages": [{"role": "user", "content": "from the journal"}]}
    (out / "partial.jsonl").write_text(json.dumps(third) + "\n" + '{"id": "torn')
    summary = regenerate(str(tiny_llama_dir), [data], out, max_new_tokens=6)
    assert summary["resumed_records"] == 3 and summary["kept"] == 4
    assert read_chats(out)[:2] == first and read_chats(out)[2]["messages"] == third["messages"]
    assert not (out / "partial.jsonl").exists()
    again = regenerate(str(tiny_llama_dir), [data], out, max_new_tokens=6)
    assert again["resumed_records"] == 4 and again["new_tokens"] == 0
    changed = regenerate(str(tiny_llama_dir), [data], out, max_new_tokens=5)
    assert changed["resumed_records"] == 0 and changed["new_tokens"] > 0


def test_bad_records_are_counted_and_strict_fails(tmp_path, tiny_llama_dir):
    rows = [RECORDS[0], "{not json", {"messages": [{"role": "robot", "content": "x"}]},
            {"messages": [{"role": "user", "content": "  "}]}, {"messages": [{"role": "system", "content": "s"}]},
            RECORDS[1]]
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    summary = regenerate(str(tiny_llama_dir), [data], tmp_path / "out", max_new_tokens=4)
    assert summary["kept"] == 2 and summary["records_read"] == 6
    assert summary["dropped"] == {"empty content": 1, "invalid JSON": 1, "no_user_turn": 1, "unknown role": 1}
    with pytest.raises(UserError, match=r"bad\.jsonl:2"):
        regenerate(str(tiny_llama_dir), [data], tmp_path / "strict", max_new_tokens=4, strict=True)
    with pytest.raises(UserError, match="does not exist"):
        regenerate(str(tiny_llama_dir), [tmp_path / "missing.jsonl"], tmp_path / "x")


class _Server:
    """A deterministic OpenAI-compatible server on 127.0.0.1 that stops by itself after ``lifetime`` s."""

    def __init__(self, status: int = 200, lifetime: float = 60.0):
        self.requests: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"path": self.path, **body})
                last = body["messages"][-1]["content"]
                content = f"[{len(body['messages'])}] {last[::-1]}"
                reply = {"choices": [{"message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
                         "usage": {"completion_tokens": 5}}
                data = json.dumps(reply).encode() if status == 200 else b'{"error": "bad model"}'
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = HTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.timeout = 0.2
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.deadline = time.monotonic() + lifetime
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stopped.is_set() and time.monotonic() < self.deadline:
            self.httpd.handle_request()
        self.httpd.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stopped.set()
        self.thread.join(timeout=5)


def test_endpoint_backend(tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    with _Server() as server:
        summary = regenerate("smollm2-135m", [data], tmp_path / "out", endpoint=server.url, max_new_tokens=7,
                             batch_size=2)
    chats = read_chats(tmp_path / "out")
    assert summary["backend"] == "endpoint" and summary["kept"] == 4 and summary["new_tokens"] == 25
    assert chats[0]["messages"][1]["content"] == "[1] .ruoloc a emaN"
    assert chats[1]["messages"][2]["content"] == "[2] ?2 + 2 si tahW"
    two = chats[2]["messages"]
    assert two[1]["content"] == "[1] ereht iH" and two[3]["content"] == "[3] erom em lleT"
    assert len(server.requests) == 5 and all(r["temperature"] == 0.0 and r["seed"] == 0 for r in server.requests)
    assert {r["path"] for r in server.requests} == {"/v1/chat/completions"}
    assert all(r["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and r["max_tokens"] == 7 for r in server.requests)
    # the second turn was asked with the regenerated first answer, never the original
    second = next(r for r in server.requests if len(r["messages"]) == 3)
    assert second["messages"][1]["content"] == "[1] ereht iH"


def test_endpoint_extra_answers_ask_with_their_own_temperature_and_seed(tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", RECORDS[:2])
    with _Server() as server:
        summary = regenerate("m", [data], tmp_path / "out", endpoint=server.url, seed=5, extra_answers=1,
                             extra_temperature=0.7)
    assert summary["kept"] == 4 and summary["seed"] == 5 and summary["extra_temperature"] == 0.7
    asked = sorted((r["messages"][-1]["content"], r["temperature"], r["seed"]) for r in server.requests)
    assert asked == [("Name a colour.", 0.0, 5), ("Name a colour.", 0.7, 6),
                     ("What is 2 + 2?", 0.0, 5), ("What is 2 + 2?", 0.7, 6)]
    assert [c["id"].endswith("~1") for c in read_chats(tmp_path / "out")] == [False, True, False, True]


def test_endpoint_errors_are_one_sentence(tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", RECORDS[:1])
    with _Server(status=400) as server, pytest.raises(UserError, match="HTTP 400"):
        regenerate("m", [data], tmp_path / "out", endpoint=server.url)
    assert chat_completions_url("http://h:8000/v1") == "http://h:8000/v1/chat/completions"
    assert chat_completions_url("http://h:8000/") == "http://h:8000/v1/chat/completions"


def test_cli(tmp_path, tiny_llama_dir, capsys):
    """As people chain the stages: regenerate's output folder is prepare's --data (its chats.jsonl)."""
    data = write_jsonl(tmp_path / "in.jsonl", RECORDS[:2])
    rc = main(["regenerate", "--verifier", str(tiny_llama_dir), "--data", str(data), "--out", str(tmp_path / "o"),
               "--max-new-tokens", "4", "--batch-size", "2"])
    assert rc == 0 and len(read_chats(tmp_path / "o")) == 2
    rc = main(["prepare", "--verifier", str(tiny_llama_dir), "--data", str(tmp_path / "o"), "--out",
               str(tmp_path / "prepared")])
    summary = json.loads((tmp_path / "prepared" / "summary.json").read_text())
    assert rc == 0 and summary["kept"] == 2 and summary["data"] == [str(tmp_path / "o" / "chats.jsonl")]
    (tmp_path / "plain").mkdir()
    assert main(["prepare", "--verifier", str(tiny_llama_dir), "--data", str(tmp_path / "plain"), "--out",
                 str(tmp_path / "p2")]) == 1
    assert "is a folder but neither a `datasets` save_to_disk folder nor a stage's output folder" in \
        capsys.readouterr().err


def test_vllm_backend_falls_back_in_process_when_its_environment_cannot_be_built(tmp_path, tiny_llama_dir,
                                                                                  monkeypatch, caplog):
    monkeypatch.setenv("PYTHON", str(tmp_path / "no-such-python"))  # scripts/vllm_env.sh fails at once
    data = write_jsonl(tmp_path / "in.jsonl", RECORDS[:2])
    summary = regenerate(str(tiny_llama_dir), [data], tmp_path / "out", backend="vllm", vllm_venv=tmp_path / "venv",
                         max_new_tokens=4)
    assert summary["backend"] == "transformers" and summary["kept"] == 2
    (warning,) = [r.getMessage() for r in caplog.records if "backend vllm is not available" in r.getMessage()]
    assert "\n" not in warning and "scripts/vllm_env.sh failed" in warning and warning.endswith("instead")
    assert (tmp_path / "out" / "vllm-env.log").is_file()
    with pytest.raises(UserError, match="--endpoint goes with --backend endpoint"):
        regenerate(str(tiny_llama_dir), [data], tmp_path / "x", backend="vllm", endpoint="http://127.0.0.1:1")


def test_record_ids_follow_content_so_a_refresh_answers_only_new_records(tmp_path, tiny_llama_dir):
    """Ids are the file's name, the messages and how many identical records came before in that file, not line
    numbers: a record inserted above the others, or a new file, costs only its own answer."""
    data = write_jsonl(tmp_path / "logs.jsonl", [*RECORDS[:2], RECORDS[0]])  # a duplicate keeps its own id
    out = tmp_path / "out"
    first = regenerate(str(tiny_llama_dir), [data], out, max_new_tokens=4)
    ids = [c["id"] for c in read_chats(out)]
    assert first["kept"] == 3 and len(set(ids)) == 3
    write_jsonl(data, [{"messages": [{"role": "user", "content": "A new first line."}]}, *RECORDS[:2], RECORDS[0]])
    more = write_jsonl(tmp_path / "more.jsonl", [RECORDS[3]])
    second = regenerate(str(tiny_llama_dir), [data, more], out, max_new_tokens=4)
    assert second["resumed_records"] == 3 and second["kept"] == 5
    assert [c["id"] for c in read_chats(out)][1:4] == ids
