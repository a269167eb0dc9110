"""The requests to the target and the run over every prompt.

One chat request per turn (with ``return_token_ids``, retried on transient failures), every
prompt's turns in order and the prompts concurrently, each record appended to the partial file
as it arrives; with capture, waiting for the states the server saves. Also the prefill of
recorded answers on a capturing server, the final records and their counts, and the settings
the run takes from the config.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from eaglet.core.io import request_lock, request_path, writer_done
from eaglet.core.progress import Progress, now_iso
from eaglet.engine.capture import prefill_each
from eaglet.engine.client import RequestFailed, gather_or_cancel, post_json, with_retries
from eaglet.engine.server import ServerError
from eaglet.stages.generate.answers import (
    Sampling,
    answer_settings,
    append_record,
    drop_stale,
    next_turn,
    read_partial,
    turn_ids,
    turns_left,
)
from eaglet.target.states import ExtractionError  # torch-heavy, only here

log = logging.getLogger("eaglet.stages.generate")


# -- one request -----------------------------------------------------------------------------


def build_messages(prompt: dict, system_prompt: str | list | None) -> list[dict]:
    messages = list(prompt["messages"])
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def parse_response(body: dict) -> dict:
    """The fields eaglet keeps from a chat completion made with ``return_token_ids``."""
    choice = body["choices"][0]
    message = choice.get("message") or {}
    prompt_ids = body.get("prompt_token_ids") or choice.get("prompt_token_ids")
    completion_ids = choice.get("token_ids")
    if prompt_ids is None or completion_ids is None:
        raise RequestFailed(
            "the server returned no token ids: it must accept `return_token_ids` "
            "(vLLM >= 0.10.2); eaglet trains on the exact ids the model emitted",
            retryable=False,
        )
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")
    return {
        "content": message.get("content"),
        "reasoning": reasoning,
        "prompt_token_ids": prompt_ids,
        "completion_token_ids": completion_ids,
        "finish_reason": choice.get("finish_reason"),
        "usage": body.get("usage"),
    }


async def chat_once(
    client: httpx.AsyncClient,
    model: str,
    messages: list[dict],
    sampling: Sampling,
    timeout: float,
    extra: dict | None = None,
    seeded: bool = True,
) -> dict:
    payload = {
        "model": model,
        "messages": messages,
        **sampling.request(),
        **({"seed": sampling.seed} if seeded else {}),
        "return_token_ids": True,
        # the text exactly as the ids spell it: vLLM's detokenizer otherwise puts a space
        # between an added token and the text beside it for tokenizers that are not
        # `tokenizers`-backed (Kimi's tiktoken one): the reasoning after the prompt's
        # <think> came back as " The", every sample then failed the template check
        "spaces_between_special_tokens": False,
        **(extra or {}),
    }
    return parse_response(await post_json(client, "/v1/chat/completions", payload, timeout))


async def chat_with_retries(
    client,
    model,
    messages,
    sampling,
    timeout,
    max_retries,
    backoff_s: float = 1.0,
    health_check=None,
    extra: dict | None = None,
    seeded: bool = True,
) -> dict:
    return await with_retries(
        lambda: chat_once(client, model, messages, sampling, timeout, extra, seeded),
        max_retries,
        backoff_s,
        health_check,
    )


async def resolve_model_name(client: httpx.AsyncClient, model_name: str | None = None) -> str:
    """The served model's name (``model_name`` when given), asked at ``/v1/models``; a server
    that does not answer there stops the stage at once, with its URL named."""
    try:
        resp = await client.get("/v1/models", timeout=30)
    except httpx.TransportError as exc:
        raise RuntimeError(
            f"no server answers at {client.base_url} ({type(exc).__name__}: {exc}). Check that "
            f"it runs and listens on that host and port and that server.url is right, or set "
            f"server.url: null to let eaglet start vLLM itself"
        ) from exc
    if model_name:
        return model_name
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise RuntimeError("the server lists no models at /v1/models; set server.model_name")
    return models[0]["id"]


# -- the run ---------------------------------------------------------------------------------


@dataclass
class GenerationSettings:
    base_url: str
    sampling: Sampling
    concurrency: int
    request_timeout_s: float
    max_retries: int
    system_prompt: str | list | None = None
    model_name: str | None = None
    api_key: str | None = None
    # the server saves each answer's hidden states here (generate.capture_hidden_states)
    capture_dir: str | None = None
    # variables of the chat template (generate.chat_template_kwargs), kept in every record
    chat_template_kwargs: dict | None = None
    # each request carries generate.seed (False: the server was started with it, see
    # engine_seeding)
    seed_per_request: bool = True

    def request_extra(self, record_id: str) -> dict:
        """What a request adds to the chat completion: the template variables, and with
        capture, where the server saves the states of its prompt and of every generated token
        (all but the last, which no forward pass has read yet)."""
        extra: dict = {}
        if self.chat_template_kwargs:
            extra["chat_template_kwargs"] = dict(self.chat_template_kwargs)
        if self.capture_dir is not None:
            extra["kv_transfer_params"] = {
                "include_output_tokens": True,
                "hidden_states_path": str(request_path(self.capture_dir, record_id)),
            }
        return extra


async def generate_async(
    prompts: list[dict],
    settings: GenerationSettings,
    partial_path: str | os.PathLike,
    progress: Progress | None = None,
    health_check=None,
    too_long=None,
) -> dict[str, dict]:
    """Generate an answer for every prompt not yet answered in ``partial_path``.

    Returns the latest record per prompt id (answers, failures and skips). ``health_check``
    is called between requests and may raise to abort (e.g. the server process died);
    ``too_long(messages)`` says why a prompt cannot be asked (it is then recorded as skipped
    and its conversation ends), or None.
    """
    done = drop_stale(
        read_partial(partial_path),
        answer_settings(
            settings.sampling,
            settings.chat_template_kwargs,
            settings.capture_dir is not None,
            settings.system_prompt,
        ),
    )
    answered = lambda rid: rid in done and "error" not in done[rid]  # noqa: E731
    pending = [p for p in prompts if turns_left(p, done)]
    requests = sum(len(turn_ids(p)) for p in prompts)
    finished = requests - sum(turns_left(p, done) for p in prompts)
    if done:
        log.info(
            "resuming: %d of %d answers already there, %d prompts to go",
            finished,
            requests,
            len(pending),
        )
    if progress is not None:
        progress.restart(already_done=finished)
        if progress.phase is not None:
            progress.enter_phase(None)  # the server is up: the counted work starts now
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    limits = httpx.Limits(
        max_connections=settings.concurrency, max_keepalive_connections=settings.concurrency
    )
    Path(partial_path).parent.mkdir(parents=True, exist_ok=True)
    async with httpx.AsyncClient(
        base_url=settings.base_url, headers=headers, limits=limits
    ) as client:
        model = await resolve_model_name(client, settings.model_name)
        gate = asyncio.Semaphore(settings.concurrency)
        with open(partial_path, "a") as out:

            async def one(prompt: dict) -> None:
                """Every turn of one prompt, in order; a failed turn ends the conversation."""
                async with gate:
                    messages = build_messages(prompt, settings.system_prompt)
                    ids, followups = turn_ids(prompt), prompt.get("followups", [])
                    for turn, record_id in enumerate(ids):
                        if turn:
                            messages = next_turn(messages, done[ids[turn - 1]], followups[turn - 1])
                        if answered(record_id):
                            continue
                        reason = too_long(messages) if too_long is not None else None
                        if reason is not None:
                            skip(record_id, prompt, turn, messages, reason)
                            break
                        if health_check is not None:
                            health_check()
                        record = await answer(record_id, prompt, turn, messages)
                        if "error" in record:
                            break

            def skip(
                record_id: str, prompt: dict, turn: int, messages: list[dict], reason: str
            ) -> None:
                record = {
                    "id": record_id,
                    "source": prompt.get("source"),
                    "messages": messages,
                    "skipped": reason,
                    "created_at": now_iso(),
                }
                append_record(out, record)
                done[record_id] = record
                log.info("%s not asked: %s", record_id, reason)
                if progress is not None:
                    progress.advance(done=1)

            async def answer(record_id: str, prompt: dict, turn: int, messages: list[dict]) -> dict:
                record = {
                    "id": record_id,
                    "source": prompt.get("source"),
                    "messages": messages,
                    "model": model,
                    "sampling": settings.sampling.settings(),
                }
                if settings.chat_template_kwargs:  # the template check renders with them
                    record["chat_template_kwargs"] = dict(settings.chat_template_kwargs)
                if settings.system_prompt:
                    record["system_prompt"] = settings.system_prompt
                if turn:
                    record.update(prompt_id=prompt["id"], turn=turn + 1)
                try:
                    record.update(
                        await chat_with_retries(
                            client,
                            model,
                            messages,
                            settings.sampling,
                            settings.request_timeout_s,
                            settings.max_retries,
                            health_check=health_check,
                            extra=settings.request_extra(record_id),
                            seeded=settings.seed_per_request,
                        )
                    )
                except RequestFailed as exc:
                    record["error"] = str(exc)
                if settings.capture_dir is not None and "error" not in record:
                    # the connector writes after answering: a record stands for saved states
                    path = request_path(settings.capture_dir, record_id)
                    saved = await asyncio.to_thread(wait_for_saved, path)
                    record["hidden_states"] = "saved" if saved else "missing"
                    if not saved:
                        log.warning(
                            "%s: the server saved no hidden states to %s within %d s; "
                            "extraction will compute them",
                            record_id,
                            path,
                            SAVE_WAIT_S,
                        )
                record["created_at"] = now_iso()
                append_record(out, record)
                done[record_id] = record
                if progress is not None:
                    ok = "error" not in record
                    progress.advance(
                        done=int(ok),
                        failed=int(not ok),
                        tokens=len(record.get("completion_token_ids") or []),
                    )
                return record

            await gather_or_cancel(one(p) for p in pending)
    return done


def prefill_recorded(
    url: str, records: list[dict], capture_dir: str, cfg: dict, health_check=None
) -> int:
    """generate.capture_hidden_states with recorded answers (``answers: dataset``): each
    recorded sample whose states are not saved yet goes to the capturing server as one
    prefill request, so that extraction packs them with the generated ones instead of
    loading the target a second time. Returns how many were saved; a failure (the server's
    death too, which ``health_check`` reports) leaves the rest to extraction (with a
    warning), it does not fail generation."""

    paths = [request_path(capture_dir, r["id"]) for r in records]
    work = [
        (r["prompt_token_ids"] + r["completion_token_ids"], path)
        for r, path in zip(records, paths)
        if not path.exists()
    ]
    gen = cfg["generate"]  # the stage's config holds generation's sections, not extract's
    saved = 0

    async def after(i: int) -> None:
        nonlocal saved
        # the connector writes after answering: wait until the file is whole
        written = await asyncio.to_thread(wait_for_saved, work[i][1])
        saved += written

    if work:
        log.info(
            "prefilling %d recorded answers on the capturing server (%d saved before)",
            len(work),
            len(records) - len(work),
        )
        try:
            asyncio.run(
                prefill_each(
                    url,
                    work,
                    gen["concurrency"],
                    gen["request_timeout_s"],
                    gen["max_retries"],
                    after,
                    health_check,
                )
            )
        except (ExtractionError, ServerError) as exc:
            log.warning(
                "prefilling the recorded answers failed (%s): %d of %d saved, "
                "extraction will compute the rest",
                exc,
                saved,
                len(work),
            )
    return saved


SAVE_WAIT_S = 60


def wait_for_saved(path: Path, timeout_s: float = SAVE_WAIT_S) -> bool:
    """Wait until the capture connector has written ``path`` whole: the file exists and its
    writer released the lock beside it."""
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and writer_done(path, wait=False)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def discard_saved(path: Path) -> None:
    """Remove the states a capturing server saved for a request that is no sample's, once its
    writer is done (the connector writes after it answers), and the lock beside them."""
    wait_for_saved(path)
    path.unlink(missing_ok=True)
    request_lock(path).unlink(missing_ok=True)


def generate(
    prompts: list[dict],
    settings: GenerationSettings,
    partial_path,
    progress: Progress | None = None,
    health_check=None,
    too_long=None,
) -> dict[str, dict]:
    return asyncio.run(
        generate_async(prompts, settings, partial_path, progress, health_check, too_long)
    )


def collect(
    prompts: list[dict], records: dict[str, dict], keep_truncated: bool
) -> tuple[list[dict], dict]:
    """Final records in prompt order, and the counts that go into stats.json."""
    kept, failed, truncated, dropped, unasked, too_long = [], [], 0, 0, 0, 0
    for prompt in prompts:
        ids = turn_ids(prompt)
        for turn, record_id in enumerate(ids):
            record = records.get(record_id)
            if record is None:
                raise RuntimeError(f"{record_id} has no record: generation did not finish")
            if "skipped" in record:
                too_long += 1
                unasked += len(ids) - turn - 1
                break
            if "error" in record:
                failed.append({"id": record["id"], "error": record["error"]})
                unasked += len(ids) - turn - 1  # the conversation stops at a failed turn
                break
            if record["finish_reason"] == "length":
                truncated += 1
                if not keep_truncated:
                    dropped += 1
                    continue
            kept.append(record)
    counts = {
        "prompts": len(prompts),
        "samples": len(kept),
        "failed": len(failed),
        "too_long": too_long,
        "later_turns_not_asked": unasked,
        "truncated": truncated,
        "truncated_dropped": dropped,
        "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in kept),
        "completion_tokens": sum(len(r["completion_token_ids"]) for r in kept),
        "failures": failed[:50],
    }
    return kept, counts


def api_key_from_env(var: str | None) -> str | None:
    if not var:
        return None
    key = os.environ.get(var)
    if not key:
        raise RuntimeError(f"server.api_key_env names ${var}, but it is not set in the environment")
    return key


def engine_seeding(cfg: dict[str, Any]) -> tuple[bool, list[str]]:
    """How the server eaglet starts is seeded: (whether each request carries generate.seed,
    the server's own arguments). Sampled answers on vLLM's CPU engine (server.gpus 0) are
    seeded by the engine (``--seed``), not per request: a seeded request takes vLLM's
    per-request generator path, which rewinds the generator's offset after a step that
    prefilled part of a long prompt, and a CPU generator has no offset; the engine died
    (RuntimeError: CPU Generator does not use offset) at the first such step."""
    gen = cfg["generate"]
    if gen["temperature"] > 0 and not cfg["server"]["gpus"]:
        return False, ["--seed", str(gen["seed"])]
    return True, []


def settings_from_config(cfg: dict[str, Any], base_url: str) -> GenerationSettings:
    gen, server = cfg["generate"], cfg["server"]
    return GenerationSettings(
        base_url=base_url,
        sampling=Sampling.from_config(gen),
        concurrency=gen["concurrency"],
        request_timeout_s=gen["request_timeout_s"],
        max_retries=gen["max_retries"],
        system_prompt=gen["system_prompt"],
        model_name=server["model_name"],
        chat_template_kwargs=gen["chat_template_kwargs"],
        api_key=api_key_from_env(server["api_key_env"]),
    )
