"""The docs site builds strictly, every command of ours in the README and the docs parses, and every message
docs/troubleshooting.md quotes is one the code raises."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest

from docs_commands import ROOT, all_commands
from tiny_speculators.cli import parse_command
from tiny_speculators.errors import UserError

COMMANDS = all_commands()


def test_the_docs_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: a broken link, a page missing from the nav or an API reference that does not
    resolve fails."""
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


def test_the_docs_name_commands():
    files = {c.file for c in COMMANDS}
    assert "README.md" in files and "docs/getting-started.md" in files, files
    assert any(c.run for c in COMMANDS), "no docs block is marked to be run"


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_every_command_in_the_docs_parses(command, monkeypatch):
    """Each command's flags exist, its values have the types and choices its stage takes, and a `--config` it
    names exists and binds. Paths need not exist: the commands are read, not run (the marked blocks are run by
    test_docs_chain.py)."""
    monkeypatch.chdir(ROOT)
    if command.words and command.words[0] in ("--version", "--help", "-h"):
        return
    try:
        parsed = parse_command(command.words)
    except SystemExit as e:  # argparse's refusal, already printed to stderr
        pytest.fail(f"{command}: refused by the CLI's parser (exit {e.code})")
    except UserError as e:
        pytest.fail(f"{command}: {e}")
    assert parsed is not None, f"{command}: names no stage"


def _message_templates() -> list[str]:
    """Every string the package's code builds, an f-string's fields written as '…'."""
    templates = []
    for path in (ROOT / "src" / "tiny_speculators").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.JoinedStr):
                templates.append("".join(v.value if isinstance(v, ast.Constant) else "…" for v in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                templates.append(node.value)
    return templates


def _quoted_messages() -> list[str]:
    text = (ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    return [m.strip() for m in re.findall(r"^```text\n(.*?)^```", text, flags=re.S | re.M)]


def test_every_troubleshooting_message_is_raised_by_the_code():
    """docs/troubleshooting.md quotes each message in a ```text block, '…' where the code fills something in; the
    quote must match one message template of the code (an f-string's fields standing for any text)."""
    messages = _quoted_messages()
    assert len(messages) >= 10, "docs/troubleshooting.md quotes fewer than ten messages"
    templates = _message_templates()
    missing = []
    for message in messages:
        pattern = re.compile(".*".join(re.escape(piece) for piece in message.split("…")), flags=re.S)
        if not any(pattern.search(t) for t in templates):
            missing.append(message)
    assert not missing, f"quoted in docs/troubleshooting.md, raised nowhere in src/: {missing}"


def test_the_message_check_tells_a_made_up_message_apart():
    templates = _message_templates()
    made_up = re.compile(re.escape("the flux capacitor of ") + ".*" + re.escape(" is not charged"))
    assert not any(made_up.search(t) for t in templates)
    real = re.compile(re.escape("unknown stage ") + ".*" + re.escape(" (known: "))
    assert any(real.search(t) for t in templates)


def test_no_doc_links_to_a_machine_path():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"/(home|Users|work|tmp)/[\w.-]+/", text), f"{path.name} names a machine path"


def test_a_wrong_flag_in_a_doc_fails(tmp_path):
    """The parse check is not a test that cannot fail: a made-up flag and a bad choice are refused."""
    from docs_commands import commands_in

    bad = commands_in("```bash\ntiny-speculators vocab --data a --size 10 --out b --no-such-flag 1\n"
                      "tiny-speculators train --verifier v --out o --precision fp7\n```\n", "x.md")
    assert len(bad) == 2
    for command in bad:
        with pytest.raises(SystemExit):
            parse_command(command.words)


def test_commands_are_read_across_continuations_and_chains():
    from docs_commands import commands_in

    text = ("<!-- docs-test: run -->\n```bash\nFOO=1 tiny-speculators vocab --data a \\\n    --size 8 --out b  # c\n"
            "pip install x && torchrun --nproc-per-node 2 -m tiny_speculators.cli train --out o\n```\n")
    got = commands_in(text, "x.md")
    assert [c.words for c in got] == [("vocab", "--data", "a", "--size", "8", "--out", "b"), ("train", "--out", "o")]
    assert all(c.run for c in got)


def test_the_docs_do_not_name_a_file_that_is_not_in_the_repository():
    """Links like configs/x.yaml or scripts/y.sh in the docs' prose and commands point at real files."""
    pattern = re.compile(r"(?<![\w/.-])((?:configs|scripts|benchmarks|examples|dev)/[\w./-]+\.(?:yaml|sh|py|md))")
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for name in pattern.findall(path.read_text(encoding="utf-8")):
            assert (ROOT / name).exists(), f"{path.relative_to(ROOT)} names {name}, which does not exist"

