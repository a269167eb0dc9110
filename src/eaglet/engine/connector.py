"""eaglet's hidden-states connector for vLLM's ``extract_hidden_states`` method.

vLLM keeps the states of the layers named in the speculative config in a cache-only KV layer
and hands every finished request's blocks to a KV connector. Its example connector copies
them with CUDA streams, events and pinned memory, which the CPU build does not have. This
subclass keeps that asynchronous path on CUDA and, on any other device, gathers the rows of
the request's slots with a plain copy and writes them synchronously (to a temporary name,
then renamed, so a file that exists is complete).

The server loads it by name::

    --kv-transfer-config '{"kv_connector": "EagletHiddenStatesConnector",
                           "kv_connector_module_path": "eaglet.engine.connector",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"shared_storage_path": DIR}}'

Each file holds ``hidden_states`` [tokens, layers, H] (layers in the order of
``eagle_aux_hidden_state_layer_ids``) and ``token_ids`` [tokens].
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
)

from eaglet.core.io import request_lock

__all__ = ["EagletHiddenStatesConnector", "slot_mapping", "gather_states", "write_states"]


class _Done:
    """Stands in for the CUDA event of a finished copy: the CPU copy is done on return."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def slot_mapping(block_ids: list[int], block_size: int) -> torch.Tensor:
    """Cache slots of a request's blocks, in token order: block b holds slots
    b*block_size .. b*block_size + block_size - 1."""
    blocks = torch.tensor(block_ids, dtype=torch.long)
    offsets = torch.arange(block_size, dtype=torch.long)
    return (blocks[:, None] * block_size + offsets[None, :]).flatten()


def gather_states(kv_cache: torch.Tensor, slots: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Rows [num_tokens, layers, H] of a cache laid out [blocks, layers, block_size, H]."""
    block_size = kv_cache.shape[2]
    slots = slots[:num_tokens].to(kv_cache.device)
    return kv_cache[slots // block_size, :, slots % block_size]


def write_states(hidden_states: torch.Tensor, token_ids: torch.Tensor, filename: str) -> None:
    """Save one request's states; the file appears complete or not at all."""
    os.makedirs(os.path.dirname(filename) or ".", exist_ok=True)
    tmp = f"{filename}.tmp{os.getpid()}"
    save_file(
        {"hidden_states": hidden_states.contiguous(), "token_ids": token_ids.contiguous()}, tmp
    )
    os.replace(tmp, filename)


class EagletHiddenStatesConnector(ExampleHiddenStatesConnector):
    """vLLM's hidden-states connector with a synchronous write on CPU."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is not None and self._kv_cache.is_cuda:
            super()._submit_async_write(pending)  # CUDA: copy stream, pinned memory, threads
            return
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None, "register_kv_caches was not called"
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
            lock_fd = os.open(
                request_lock(pending.filename), os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644
            )
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            slots = slot_mapping(pending.block_ids, self._block_size)
            states = gather_states(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
            write_states(states, pending.token_ids.clone(), pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the lock a reader may wait on
        self._req_copy_events[pending.req_id] = _Done()
