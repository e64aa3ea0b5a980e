"""The Mooncake master the trainer starts: it listens on 127.0.0.1, is stopped with its block (also on an error),
and a master nobody runs is a one-line error. Needs the Mooncake wheel and its system libraries (``.ci/run``
installs both); the vLLM producers are tested in ``tests/train/test_producer_source.py``."""

from __future__ import annotations

import pytest

from tiny_speculators.errors import UserError
from tiny_speculators.producers import MooncakeMaster, check_master, import_mooncake_store, kv_transfer_config
from tiny_speculators.serving import free_port


@pytest.fixture(scope="module")
def mooncake() -> None:
    try:
        import_mooncake_store()
    except UserError as e:
        pytest.skip(f"Mooncake is not usable here: {e}")


def test_master_listens_while_its_block_runs_and_is_stopped_after(mooncake, tmp_path):
    with MooncakeMaster(tmp_path / "master.log") as master:
        process = master.process
        check_master(master.address)
        assert master.address.startswith("127.0.0.1:")
    assert process.poll() is not None
    with pytest.raises(UserError, match=f"no Mooncake master answers at {master.address}"):
        check_master(master.address)


def test_master_is_stopped_when_its_block_fails(mooncake, tmp_path):
    with pytest.raises(RuntimeError, match="boom"), MooncakeMaster(tmp_path / "master.log") as master:
        process = master.process
        raise RuntimeError("boom")
    assert process.poll() is not None


def test_a_taken_master_port_is_a_one_line_error(mooncake, tmp_path):
    with MooncakeMaster(tmp_path / "a.log") as first, pytest.raises(UserError) as err, \
            MooncakeMaster(tmp_path / "b.log", port=first.port):  # the first one's port
        pass
    assert str(err.value) == (f"port {first.port} on 127.0.0.1 is in use (Address already in use): pick another "
                              "Mooncake master port")


def test_ports_taken_between_picking_and_binding_are_picked_again(mooncake, tmp_path, monkeypatch):
    """A busy machine can take a port the master was handed before it binds it (CI saw it for the metrics port):
    the master starts on fresh ports; a port the user chose is never swapped, and its failure names the reason."""
    import socket

    from tiny_speculators import producers

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([[free_port(), busy]])
        real = producers.free_ports
        monkeypatch.setattr(producers, "free_ports", lambda n: next(picks, None) or real(n))
        with MooncakeMaster(tmp_path / "master.log") as master:
            check_master(master.address)
        assert "Address already in use" in (tmp_path / "master.log").read_text()  # the first try did fail

        picks = iter([[busy, busy]])
        reason = rf"^mooncake_master exited while starting \(exit code 1: E\d{{4}} .*:{busy}: Address already in use"
        with pytest.raises(UserError, match=reason), MooncakeMaster(tmp_path / "own.log", port=free_port()):
            pass


def test_no_master_and_bad_addresses_are_one_line_errors():
    port = free_port()
    with pytest.raises(UserError, match=rf"^no Mooncake master answers at 127.0.0.1:{port} \(Connection refused\)"):
        check_master(f"127.0.0.1:{port}")
    for bad in ("localhost", "host:", ":50051", "host:99999"):
        with pytest.raises(UserError, match="--mooncake-master .* is not HOST:PORT"):
            check_master(bad)


def test_producer_connector_config_names_our_module_and_the_master():
    cfg = kv_transfer_config("10.0.0.5:50051", hostname="10.0.0.7")
    assert cfg["kv_connector"] == "CpuMooncakeHiddenStatesConnector" and cfg["kv_role"] == "kv_producer"
    assert cfg["kv_connector_module_path"] == "mooncake_connector"
    store = cfg["kv_connector_extra_config"]["mooncake"]
    assert store["master_server_address"] == "10.0.0.5:50051" and store["local_hostname"] == "10.0.0.7"
    assert store["protocol"] == "tcp" and store["global_segment_size"] > 0


def test_the_readmes_producer_command_is_what_the_code_builds():
    """The hand-started producer in docs/scale-out.md passes the configs ``producer_server`` passes (no drift)."""
    import json
    import re
    from pathlib import Path

    from tiny_speculators.producers import speculative_config

    readme = (Path(__file__).resolve().parents[1] / "docs" / "scale-out.md").read_text(encoding="utf-8")
    spec = json.loads(re.search(r"--speculative-config '([^']+)'", readme).group(1))
    kv = json.loads(re.search(r"--kv-transfer-config '([^']+)'", readme).group(1))
    assert spec == speculative_config([2, 15, 27, 30])
    assert kv == kv_transfer_config("10.0.0.5:50051", hostname="10.0.0.7")
    assert "PYTHONPATH=src/tiny_speculators/vllm_plugins " in readme
