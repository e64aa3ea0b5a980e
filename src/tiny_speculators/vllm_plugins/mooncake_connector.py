"""vLLM KV connector for ``train --producer vllm``: hs-connectors' Mooncake hidden-states connector, also on CPU.

Runs inside the vLLM environment only (vLLM imports it through ``kv_connector_module_path``, with this folder on
``PYTHONPATH``), so it imports nothing from tiny-speculators. hs-connectors' connector copies each finished
request's extracted hidden states out of the KV cache on an accelerator stream and puts them into the Mooncake
store; a CPU-only vLLM has no accelerator (``torch.accelerator.current_accelerator()`` is ``None``) and no
events, so there the copy runs synchronously on the host (the forward that filled the cache has returned
by the time ``get_finished`` schedules it). On an accelerator the connector is hs-connectors' own, unchanged.

    --kv-transfer-config '{"kv_connector": "CpuMooncakeHiddenStatesConnector", "kv_role": "kv_producer",
        "kv_connector_module_path": "mooncake_connector", "kv_connector_extra_config": {"mooncake": {...}}}'
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from hs_connectors.mooncake_hidden_states_connector import MooncakeHiddenStatesConnector

__all__ = ["CpuMooncakeHiddenStatesConnector"]


class _HostEvent:
    """A CUDA-style event on the host: everything before it has already run."""

    def record(self, stream: Any = None) -> None:
        pass


class _HostStream:
    def wait_event(self, event: _HostEvent) -> None:
        pass


class _Host:
    """The subset of ``torch.cuda``'s stream API the connector uses, for synchronous host copies."""

    Stream = _HostStream
    Event = _HostEvent

    @staticmethod
    def stream(stream: _HostStream) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class CpuMooncakeHiddenStatesConnector(MooncakeHiddenStatesConnector):
    """``MooncakeHiddenStatesConnector`` with a host fallback when vLLM runs without an accelerator."""

    def _device(self) -> Any:
        if torch.accelerator.current_accelerator() is None:
            return _Host
        return super()._device()
