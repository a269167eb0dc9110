"""The HTTP client of the engines eaglet talks to: one POST, its retries, and the concurrent
requests of a stage.

Generation (chat completions) and the vllm extraction backend (prefill requests) both send
their requests through here. A connection error, a timeout or a retryable status is tried
again with backoff; ``health_check`` (the server process eaglet started, when there is one)
runs after every failure, so a server that died ends the retries at once with its own
reason instead of a connection error.
"""

from __future__ import annotations

import asyncio
import logging
import random

import httpx

log = logging.getLogger("eaglet.engine.client")

RETRYABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class RequestFailed(RuntimeError):
    """A request the engine did not answer; ``retryable`` says whether asking again may help."""

    def __init__(self, message: str, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


async def post_json(client: httpx.AsyncClient, path: str, payload: dict, timeout: float) -> dict:
    """One POST; connection errors, timeouts and the retryable statuses raise a retryable
    :class:`RequestFailed`, other non-200 answers a permanent one."""
    try:
        resp = await client.post(path, json=payload, timeout=timeout)
    except (httpx.TransportError, httpx.TimeoutException) as exc:
        raise RequestFailed(f"{type(exc).__name__}: {exc}", retryable=True) from exc
    if resp.status_code != 200:
        raise RequestFailed(
            f"HTTP {resp.status_code}: {resp.text[:500]}",
            retryable=resp.status_code in RETRYABLE_STATUS,
        )
    return resp.json()


async def with_retries(call, max_retries: int, backoff_s: float = 1.0, health_check=None):
    """``await call()``, again after a retryable :class:`RequestFailed` (exponential backoff
    with jitter, at most ``max_retries`` times); ``health_check`` runs after each failure."""
    attempt = 0
    while True:
        try:
            return await call()
        except RequestFailed as exc:
            if health_check is not None:
                health_check()  # a dead server is the stage's failure, not this request's
            if not exc.retryable or attempt >= max_retries:
                raise
            delay = backoff_s * 2**attempt * (1 + random.random())
            log.warning(
                "request failed (%s); retry %d/%d in %.1f s", exc, attempt + 1, max_retries, delay
            )
            await asyncio.sleep(delay)
            attempt += 1


async def gather_or_cancel(coroutines) -> None:
    """Run the coroutines concurrently; when one fails (or this is cancelled), cancel the
    rest and wait for them, so that no request outlives the stage that sent it."""
    tasks = [asyncio.create_task(c) for c in coroutines]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
