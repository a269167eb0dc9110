"""eaglet's vLLM hidden-states connector without an engine: the slot mapping of a request's
blocks, the rows it gathers from a cache laid out as vLLM's cache-only layer keeps it, and
the CPU write path (synchronous, complete file, lock released, request reported done)."""

from __future__ import annotations

import fcntl
import os

import pytest
import torch
from safetensors.torch import load_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import PendingSave

from eaglet.engine.connector import (
    EagletHiddenStatesConnector,
    gather_states,
    slot_mapping,
    write_states,
)

BLOCK = 4
LAYERS = 3
H = 5
NUM_BLOCKS = 6


def fake_cache() -> torch.Tensor:
    """[blocks, layers, block_size, H] where every value names its slot and layer:
    slot * 100 + layer * 10 + column."""
    cache = torch.empty(NUM_BLOCKS, LAYERS, BLOCK, H)
    for b in range(NUM_BLOCKS):
        for layer in range(LAYERS):
            for o in range(BLOCK):
                cache[b, layer, o] = (b * BLOCK + o) * 100 + layer * 10 + torch.arange(H)
    return cache


def expected_rows(slots: list[int]) -> torch.Tensor:
    return torch.stack(
        [
            torch.stack(
                [
                    s * 100 + layer * 10 + torch.arange(H, dtype=torch.float32)
                    for layer in range(LAYERS)
                ]
            )
            for s in slots
        ]
    )


def test_slot_mapping_follows_the_block_table_in_order():
    assert slot_mapping([3, 0, 5], BLOCK).tolist() == [12, 13, 14, 15, 0, 1, 2, 3, 20, 21, 22, 23]


def test_gather_takes_the_requests_slots_and_stops_at_its_tokens():
    slots = slot_mapping([2, 5], BLOCK)
    rows = gather_states(fake_cache(), slots, num_tokens=6)  # second block only half used
    assert rows.shape == (6, LAYERS, H)
    assert torch.equal(rows, expected_rows([8, 9, 10, 11, 20, 21]))


def bare_connector(cache: torch.Tensor) -> EagletHiddenStatesConnector:
    """The connector's worker side as register_kv_caches leaves it, with no engine around."""
    connector = object.__new__(EagletHiddenStatesConnector)
    connector._kv_cache = cache
    connector._block_size = BLOCK
    connector._is_tp_rank_zero = True
    connector.use_lock = True
    connector._lock_fds = {}
    connector._req_copy_events = {}
    connector._req_futures = {}
    return connector


def test_cpu_write_saves_the_rows_of_the_request(tmp_path):
    connector = bare_connector(fake_cache())
    filename = str(tmp_path / "states" / "req-1.safetensors")
    tokens = torch.tensor([7, 8, 9, 10, 11])
    connector._submit_async_write(PendingSave("req-1", filename, tokens, [4, 1]))
    saved = load_file(filename)
    assert torch.equal(saved["token_ids"], tokens)
    assert torch.equal(saved["hidden_states"], expected_rows([16, 17, 18, 19, 4]))
    assert connector._req_copy_events["req-1"].query()  # get_finished reports it done
    assert not [p for p in os.listdir(tmp_path / "states") if ".tmp" in p]


def test_cpu_write_releases_the_lock_a_reader_waits_on(tmp_path):
    connector = bare_connector(fake_cache())
    filename = str(tmp_path / "req-2.safetensors")
    lock_fd = os.open(filename + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)  # as wait_for_save leaves it
    connector._lock_fds["req-2"] = lock_fd
    connector._submit_async_write(PendingSave("req-2", filename, torch.tensor([1, 2]), [0]))
    assert "req-2" not in connector._lock_fds
    with open(filename + ".lock") as reader:  # would block forever if the lock were held
        fcntl.flock(reader, fcntl.LOCK_SH | fcntl.LOCK_NB)
    with pytest.raises(OSError):
        os.fstat(lock_fd)  # the connector closed it


def test_other_tensor_parallel_ranks_write_nothing(tmp_path):
    connector = bare_connector(fake_cache())
    connector._is_tp_rank_zero = False
    filename = tmp_path / "req-3.safetensors"
    connector._submit_async_write(PendingSave("req-3", str(filename), torch.tensor([1]), [0]))
    assert not filename.exists()


def test_write_states_replaces_atomically(tmp_path):
    path = tmp_path / "x.safetensors"
    write_states(torch.zeros(2, 1, 3), torch.tensor([1, 2]), str(path))
    write_states(torch.ones(2, 1, 3), torch.tensor([1, 2]), str(path))
    assert torch.equal(load_file(str(path))["hidden_states"], torch.ones(2, 1, 3))
    assert sorted(os.listdir(tmp_path)) == ["x.safetensors"]
