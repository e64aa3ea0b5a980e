"""The engines behind ``train --producer vllm``: a Mooncake master and vLLM servers that extract hidden states into it.

Each vLLM producer serves the verifier with vLLM's ``extract_hidden_states`` speculative method: a prompt's
forward pass writes the chosen layers' hidden states into a cache, and the KV connector (hs-connectors'
Mooncake connector, with the CPU fallback in ``vllm_plugins/mooncake_connector.py``) puts them into the Mooncake
store under the request's key; the completion's ``kv_transfer_params`` say where and how they are laid out.
The trainer ranks fetch them from the store and delete them (``train/producer_source.py``). Nothing touches disk.

The master and the producers the project starts itself run on 127.0.0.1, each owned by a context manager
(own process group, log file, always stopped). Producers and a master on other machines are reached by address.

    from tiny_speculators.producers import MooncakeMaster, producer_server
    from tiny_speculators.serving import build_vllm_env
    with MooncakeMaster(Path("runs/master.log")) as master, producer_server(
            build_vllm_env(mooncake=True), "smollm2-135m", [2, 15, 27, 30], master.address,
            log_path=Path("runs/producer0.log")) as server:
        print(server.url, master.address)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
from pathlib import Path
from typing import Any

from tiny_speculators.errors import UserError
from tiny_speculators.serving import HOST, ManagedProcess, VllmServer, check_port_free, free_ports
from tiny_speculators.verifier.load import resolve_verifier

__all__ = ["CONNECTOR", "MooncakeMaster", "check_master", "import_mooncake_store", "kv_transfer_config",
           "local_hostname", "producer_server", "speculative_config", "store_config"]

PLUGIN_DIR = Path(__file__).resolve().parent / "vllm_plugins"  # put on the producers' PYTHONPATH
CONNECTOR = "CpuMooncakeHiddenStatesConnector"
CONNECTOR_MODULE = "mooncake_connector"
SYSTEM_LIBS = "libibverbs1 libnl-3-200 libnl-route-3-200 librdmacm1"
PRODUCER_SEGMENT_BYTES = 1 << 30  # store memory each producer lends: samples wait in it until a rank fetches them
TRAINER_BUFFER_BYTES = 256 << 20  # a trainer rank's local transfer buffer (it lends no store memory)


def local_hostname() -> str:
    """The address this machine's store client gives its peers: ``$MOONCAKE_LOCAL_HOSTNAME`` (set it to the
    machine's IP when producers and trainers are on different machines), else 127.0.0.1."""
    return os.environ.get("MOONCAKE_LOCAL_HOSTNAME", HOST)


def import_mooncake_store() -> Any:
    """``mooncake.store`` (and hs-connectors' store), or a one-line :class:`UserError` saying what to install."""
    try:
        import hs_connectors.mooncake_store  # noqa: F401
        import mooncake.store
    except ImportError as e:
        if "lib" in str(e) and ".so" in str(e):
            raise UserError(f"the Mooncake wheel cannot load a system library ({e}): install the Debian/Ubuntu "
                            f"packages {SYSTEM_LIBS} (apt-get install -y {SYSTEM_LIBS})") from None
        raise UserError(f"--producer vllm needs Mooncake and hs-connectors in this environment ({e}): "
                        "pip install 'tiny-speculators[mooncake]'") from None
    return mooncake.store


def parse_address(address: str, option: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"{option} {address!r} is not HOST:PORT")
    return host, int(port)


def check_master(address: str, timeout: float = 5.0) -> None:
    """Nothing when a Mooncake master accepts connections at ``address``; else a one-line :class:`UserError`."""
    host, port = parse_address(address, "--mooncake-master")
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return
    except OSError as e:
        reason = e.strerror or type(e).__name__
    raise UserError(f"no Mooncake master answers at {address} ({reason}): start mooncake_master there, or leave "
                    "--mooncake-master unset to have the trainer start one on 127.0.0.1")


def store_config(master: str, local_hostname: str, segment_bytes: int, buffer_bytes: int) -> dict[str, Any]:
    """hs-connectors' ``MooncakeStoreConfig`` fields for one store client (TCP, peers found by handshake)."""
    return {"local_hostname": local_hostname, "metadata_server": "P2PHANDSHAKE", "master_server_address": master,
            "global_segment_size": segment_bytes, "local_buffer_size": buffer_bytes, "protocol": "tcp",
            "device_name": "", "num_writer_threads": 2}


def speculative_config(layer_ids: list[int]) -> dict[str, Any]:
    """vLLM's hidden-state extraction of ``layer_ids`` (HF ``hidden_states`` ids; N: the last layer's output)."""
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}


def kv_transfer_config(master: str, hostname: str | None = None,
                       segment_bytes: int = PRODUCER_SEGMENT_BYTES) -> dict[str, Any]:
    """The producer's KV connector: our CPU-capable subclass of hs-connectors' Mooncake connector."""
    store = store_config(master, hostname or local_hostname(), segment_bytes, segment_bytes // 2)
    return {"kv_connector": CONNECTOR, "kv_role": "kv_producer", "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_connector_extra_config": {"mooncake": store}}


def producer_server(python: Path, verifier: str, layer_ids: list[int], master: str, *, log_path: Path,
                    port: int | None = None, dtype: str = "float32", max_model_len: int = 2048,
                    kv_cache_gb: int = 2, name: str = "vLLM producer") -> VllmServer:
    """A ``vllm serve`` of ``verifier`` that puts ``layer_ids``' hidden states of every prompt into the store
    at ``master`` (a :class:`~tiny_speculators.serving.VllmServer`: use it as a context manager)."""
    return VllmServer(python, resolve_verifier(verifier), log_path=log_path, port=port, served_model_name="verifier",
                      speculative_config=speculative_config(layer_ids), dtype=dtype, max_model_len=max_model_len,
                      enforce_eager=True, kv_cache_gb=kv_cache_gb, name=name,
                      extra_args=["--kv-transfer-config", json.dumps(kv_transfer_config(master))],
                      env={"PYTHONPATH": str(PLUGIN_DIR)})


class MooncakeMaster(ManagedProcess):
    """``mooncake_master`` on a loopback port for the life of a ``with`` block (own process group, log file)."""

    name = "mooncake_master"
    poll_interval = 0.2
    stop_grace = 10.0

    def __init__(self, log_path: Path, port: int | None = None, startup_timeout: float = 60.0) -> None:
        super().__init__(log_path, port, startup_timeout)

    def start(self) -> None:
        store = import_mooncake_store()
        binary = Path(store.__file__).resolve().parent / "mooncake_master"
        if not binary.is_file():
            raise UserError(f"the Mooncake wheel has no mooncake_master binary at {binary}")
        # mooncake_master reuses a taken port without a word (another master would answer for it): check first
        if self.port is None:
            self.port, metrics_port = free_ports(2)
        else:
            check_port_free(self.port, option="Mooncake master port")
            metrics_port = next(p for p in free_ports(2) if p != self.port)
        self.launch([str(binary), "-rpc_address", HOST, "-rpc_port", str(self.port), "-metrics_host", HOST,
                     "-metrics_port", str(metrics_port), "-enable_http_metadata_server=false", "-logtostderr"])

    def answers(self) -> bool:
        """It accepts a TCP connection on its port."""
        with contextlib.suppress(OSError), socket.create_connection((HOST, self.port), timeout=1.0):
            return True
        return False

    def exit_error(self, code: int) -> UserError:
        lines = [ln.strip() for ln in self.attempt_log().splitlines() if ln.strip()]
        errors = [ln for ln in lines if re.match(r"[EF]\d{4} ", ln)]  # glog's ERROR and FATAL lines
        reason = (errors or lines or [""])[0]
        return UserError(f"mooncake_master exited while starting (exit code {code}"
                         f"{': ' + reason if reason else ''}; log: {self.log_path})")

    def timeout_error(self) -> UserError:
        return UserError(f"mooncake_master did not listen on {self.address} within "
                         f"{self.startup_timeout:.0f} s (log: {self.log_path})")
