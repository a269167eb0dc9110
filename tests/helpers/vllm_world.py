"""vLLM's process-wide state for building one of its drafter models outside the engine, in a
subprocess of a test: the engine config of a target and a speculative config, set current,
with a one-rank gloo world initialized (a free local port)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import torch


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def drafter_world(target: str, speculative_config: dict) -> Iterator[object]:
    """Yields vLLM's engine config for ``target`` (float32, eager, 256 positions) serving
    ``speculative_config``, current and with its distributed world up, under no_grad."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=target,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        speculative_config=speculative_config,
    )
    config = args.create_engine_config()
    with set_current_vllm_config(config), torch.no_grad():
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
        )
        initialize_model_parallel(1, 1)
        yield config
