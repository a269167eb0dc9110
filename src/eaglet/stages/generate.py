"""Synthetic data: ask the target every training prompt and keep exactly what it emitted.

Each finished sample is appended and flushed to ``<out>.partial.jsonl`` as soon as it
arrives, so an interrupted run resumes by prompt id: no finished sample is regenerated, lost
or duplicated. The final file appears atomically once every prompt has an answer or has
failed for good.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from transformers import AutoTokenizer

from eaglet.core import rates
from eaglet.core.io import (
    atomic_open,
    hold_directory,
    read_jsonl,
    request_lock,
    request_path,
    write_json,
    write_jsonl,
    writer_done,
)
from eaglet.core.progress import Progress, now_iso
from eaglet.data.prompts import RECORDED_ANSWER
from eaglet.data.template_check import (
    answer_format,
    answer_opening,
    check_records,
    enforce,
    render_ids,
)
from eaglet.engine.capture import capture_args, capture_layer_ids, prefill_each
from eaglet.engine.client import RequestFailed, gather_or_cancel, post_json, with_retries
from eaglet.engine.server import ServerError, target_server
from eaglet.target.checkpoint import read_target, read_target_config, text_config
from eaglet.target.states import (
    ExtractionError,  # torch-heavy, only here
    resolve_aux_layer_ids,  # torch-heavy, needed only here
)

log = logging.getLogger("eaglet.stages.generate")


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    # None: not sent, so vLLM takes the target's generation_config.json value (its default)
    top_k: int | None = None
    min_p: float | None = None

    @classmethod
    def from_config(cls, gen: dict) -> Sampling:
        return cls(
            gen["temperature"],
            gen["top_p"],
            gen["max_tokens"],
            gen["seed"],
            gen.get("top_k"),
            gen.get("min_p"),
        )

    def settings(self) -> dict:
        """What a record keeps of its sampling: the settings sent. One left to the server's
        default is left out, so that answers recorded before eaglet had it still count as made
        with the same settings."""
        return {k: v for k, v in vars(self).items() if v is not None or k not in OPTIONAL}

    def request(self) -> dict:
        """The request's sampling fields (the seed apart: see chat_once)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
            **{k: getattr(self, k) for k in OPTIONAL if getattr(self, k) is not None},
        }


OPTIONAL = ("top_k", "min_p")  # Sampling's settings a server fills in when none is sent


# -- partial file ----------------------------------------------------------------------------


def read_partial(path: str | os.PathLike) -> dict[str, dict]:
    """Latest record per prompt id from a partial file.

    Every decodable line is kept. A line that does not decode (a torn last line from a kill
    mid-write, or a damaged one anywhere) is moved to ``<path>.bad`` and counted, and the
    file is rewritten without it so that appending continues cleanly.
    """
    path = Path(path)
    if not path.exists():
        return {}
    records: dict[str, dict] = {}
    good: list[bytes] = []
    bad: list[tuple[int, bytes]] = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            record = _decode_line(raw)
            if record is None:
                bad.append((number, raw))
                continue
            good.append(raw)
            previous = records.get(record["id"])
            if previous is None or "error" in previous or "error" not in record:
                records[record["id"]] = record
    if bad:
        _set_aside(path, good, bad)
    return records


def _decode_line(raw: bytes) -> dict | None:
    """The record on one whole line of a partial file, or None when it is not one."""
    if not raw.endswith(b"\n"):
        return None  # torn: the process was killed while writing it
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) and "id" in record else None


def _set_aside(path: Path, good: list[bytes], bad: list[tuple[int, bytes]]) -> None:
    """Append the bad lines to ``<path>.bad`` and rewrite ``path`` with the good ones."""
    side = path.with_name(path.name + ".bad")
    with open(side, "ab") as handle:
        for _, raw in bad:
            handle.write(raw if raw.endswith(b"\n") else raw + b"\n")
        handle.flush()
        os.fsync(handle.fileno())
    if len(bad) == 1 and bad[0][0] == len(good) + 1:
        with open(path, "r+b") as handle:  # only a torn or bad last line: cut it off
            handle.truncate(sum(len(raw) for raw in good))
    else:
        with atomic_open(path, "wb") as handle:
            handle.writelines(good)
    lines = ", ".join(str(number) for number, _ in bad[:10]) + (", ..." if len(bad) > 10 else "")
    log.warning(
        "%d undecodable line(s) of %s (line %s) set aside in %s; the %d good records are kept",
        len(bad),
        path,
        lines,
        side,
        len(good),
    )


def append_record(handle, record: dict) -> None:
    handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    handle.flush()
    os.fsync(handle.fileno())


# -- conversations ---------------------------------------------------------------------------


def turn_ids(prompt: dict) -> list[str]:
    """Record id of each turn a prompt asks: its own id for the first, then ``<id>.t<n>``
    for the user turns in ``followups`` (each answered after the target's earlier answers)."""
    return [prompt["id"]] + [
        f"{prompt['id']}.t{n}" for n in range(2, 2 + len(prompt.get("followups", [])))
    ]


def next_turn(messages: list[dict], answer: dict, user_text: str) -> list[dict]:
    """The history for the next turn: the target's own answer (its content; chat templates
    drop the reasoning of earlier turns), then the next user message."""
    return [
        *messages,
        {"role": "assistant", "content": answer.get("content") or ""},
        {"role": "user", "content": user_text},
    ]


def answer_settings(
    sampling: Sampling,
    template_kwargs: dict | None,
    capture: bool,
    system_prompt: str | None = None,
) -> dict:
    """What an answer was made with, beyond its prompt: a record made otherwise is asked
    again (a changed max_tokens, temperature, system prompt, template switch or capture
    reruns the stage, and the partial file must not hand it the old answers)."""
    return {
        "sampling": sampling.settings(),
        "chat_template_kwargs": template_kwargs or None,
        "capture": capture,
        "system_prompt": system_prompt or None,
    }


def made_with(record: dict) -> dict:
    return {
        "sampling": record.get("sampling"),
        "chat_template_kwargs": record.get("chat_template_kwargs") or None,
        "capture": "hidden_states" in record,
        "system_prompt": record.get("system_prompt") or None,
    }


def drop_stale(records: dict[str, dict], wanted: dict) -> dict[str, dict]:
    """The records answered with the ``wanted`` settings, plus failures and skips (which
    depend on none of them); the others are logged and left to be asked again."""
    kept = {rid: r for rid, r in records.items() if "sampling" not in r or made_with(r) == wanted}
    if len(kept) < len(records):
        log.info(
            "%d answers in the partial file were made with other generation settings "
            "(sampling, system prompt, chat template variables or capture): asked again",
            len(records) - len(kept),
        )
    return kept


def turns_left(prompt: dict, records: dict[str, dict]) -> int:
    """Turns of a prompt still to ask: none after a turn skipped as too long (the
    conversation ends there), else every turn from the first without an answer."""
    ids = turn_ids(prompt)
    for turn, record_id in enumerate(ids):
        record = records.get(record_id)
        if record is not None and "skipped" in record:
            return 0
        if record is None or "error" in record:
            return len(ids) - turn
    return 0


def too_long_check(tokenizer, max_model_len: int, template_kwargs: dict | None = None):
    """``messages -> reason or None``: a prompt whose chat-template rendering leaves no room
    for an answer within ``target.max_model_len`` is skipped, not sent (the server would
    refuse it with HTTP 400 and count it as a failure)."""

    def check(messages: list[dict]) -> str | None:
        n = len(
            render_ids(
                tokenizer, messages, add_generation_prompt=True, template_kwargs=template_kwargs
            )
        )
        if n >= max_model_len:
            return (
                f"prompt of {n} tokens leaves no room within target.max_model_len={max_model_len}"
            )
        return None

    return check


class TemplateError(RuntimeError):
    """The target's chat template cannot render some prompts."""


def check_renderable(
    prompts: list[dict],
    system_prompt: str | None,
    tokenizer,
    template_kwargs: dict | None,
    listed: int = 5,
) -> None:
    """Render every prompt's first turn through the target's chat template before any server
    starts: a template that raises for some prompts (a role it refuses, a strict alternation)
    stopped generation after the server had started, with only the template's own text.
    Raises :class:`TemplateError` naming each failing prompt, its source and row."""
    failed = []
    for prompt in prompts:
        try:
            render_ids(tokenizer, build_messages(prompt, system_prompt), True, template_kwargs)
        except Exception as error:  # jinja's TemplateError, or what the template raises
            failed.append((prompt, f"{type(error).__name__}: {error}"))
    if failed:
        names = "\n".join(
            f"  {p['id']} ({p.get('source')}, row {p.get('row')}): {why}"
            for p, why in failed[:listed]
        )
        raise TemplateError(
            f"the target's chat template cannot render {len(failed)} of {len(prompts)} "
            f"prompts (generate.chat_template_kwargs {template_kwargs or {}}):\n{names}\n"
            f"Fix or drop those rows of their source, or fix the template (the target's "
            f"tokenizer_config.json or chat_template.jinja); nothing was sent to a server."
        )


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool):
    """The target's tokenizer, with the model's own code only when the config trusts it
    (``target.trust_remote_code``; the server gets the same setting). A tokenizer that is
    code shipped with the model (``auto_map`` in tokenizer_config.json, a tokenization_*.py:
    Kimi's tiktoken tokenizer) fails without it, with the setting named."""
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if trust_remote_code or "trust_remote_code" not in str(exc):
            raise
        raise RuntimeError(
            f"the target's tokenizer at {path} is code shipped with the model (auto_map in its "
            f"tokenizer_config.json), which runs only when trusted: set "
            f"target.trust_remote_code: true in the config if you trust this model's code "
            f"(the vLLM server runs it too)"
        ) from exc


# -- recorded answers (answers: dataset) -----------------------------------------------------


def end_of_turn_ids(tokenizer, target_dir: str | os.PathLike) -> set[int]:
    """Token ids the target stops at: its generation config's eos ids and the tokenizer's."""
    ids = {tokenizer.eos_token_id} - {None}
    config = Path(target_dir) / "generation_config.json"
    if config.exists():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos]) - {None}
    return ids


def dataset_record(prompt: dict, tokenizer, gen: dict, stop_ids: set[int]) -> dict:
    """The training sample of a prompt whose recorded answer is the answer (``answers:
    dataset``): prompt and answer rendered through the chat template as the server renders a
    conversation, the answer's ids ending at the first end-of-turn id the template puts after
    it (as a generated answer ends at the id the target stopped at), cut at
    ``generate.max_tokens`` (finish_reason ``length``, like a generated answer)."""

    kwargs = gen["chat_template_kwargs"]
    messages = build_messages(prompt, gen["system_prompt"])
    prompt_ids = render_ids(tokenizer, messages, add_generation_prompt=True, template_kwargs=kwargs)
    whole = render_ids(
        tokenizer,
        [*messages, {"role": "assistant", "content": prompt["answer"]}],
        add_generation_prompt=False,
        template_kwargs=kwargs,
    )
    if whole[: len(prompt_ids)] != prompt_ids:
        raise RuntimeError(
            f"{prompt['id']}: the chat template does not render a conversation with its answer "
            f"as the prompt followed by the answer, so a recorded answer cannot be placed "
            f"after the prompt the server would see: use answers: target for this target"
        )
    answer = whole[len(prompt_ids) :]
    stop = next((i for i, t in enumerate(answer) if t in stop_ids), None)
    if stop is not None:
        answer = answer[: stop + 1]
    finish = "stop"
    if len(answer) > gen["max_tokens"]:
        answer, finish = answer[: gen["max_tokens"]], "length"
    record = {
        "id": prompt["id"],
        "source": prompt.get("source"),
        "messages": messages,
        "model": RECORDED_ANSWER,
        "sampling": None,
        "content": recorded_content(tokenizer, messages, kwargs, answer, stop_ids),
        "reasoning": None,
        "prompt_token_ids": prompt_ids,
        "completion_token_ids": answer,
        "finish_reason": finish,
    }
    if kwargs:
        record["chat_template_kwargs"] = dict(kwargs)
    if gen["system_prompt"]:
        record["system_prompt"] = gen["system_prompt"]
    return record


def recorded_content(
    tokenizer,
    messages: list[dict],
    template_kwargs: dict | None,
    answer: list[int],
    stop_ids: set[int],
) -> str:
    """The content of a recorded answer's ids: their text without the end-of-turn ids and
    without what the template writes before an answer's content. A template whose
    generation prompt opens the reasoning (ends with ``<think>``) renders an answer without
    reasoning as ``</think>`` and the content: the ids keep the closer (the target would
    emit it), the content does not, as a reasoning parser would give it."""

    text = tokenizer.decode([t for t in answer if t not in stop_ids], skip_special_tokens=False)
    opening = answer_opening(tokenizer, messages, template_kwargs)
    return text[len(opening) :] if opening and text.startswith(opening) else text


# -- the server's rendering of the recorded answers' prompts ----------------------------------
#
# A recorded answer's prompt ids are eaglet's own rendering (the chat template's) until the
# server renders its messages: vLLM does not always render with the chat template, and the ids
# the server renders are what serving will see. Each rendering is kept beside the partial file,
# keyed by what it renders, so a rerun with no server up trains on the same ids.


def _rendering_key(record: dict) -> str:
    return json.dumps(
        [record["messages"], record.get("chat_template_kwargs") or None], sort_keys=True
    )


def rendered_path(partial_path: str | os.PathLike) -> Path:
    return Path(partial_path).with_name(Path(partial_path).stem + ".server_prompts.jsonl")


def apply_server_prompts(recorded: dict[str, dict], path: Path) -> int:
    """Give recorded answers the server's prompt ids kept in ``path``; how many had one."""
    kept = {}
    for row in read_jsonl(path) if path.exists() else []:
        kept[row["key"]] = row["prompt_token_ids"]
    found = 0
    for record in recorded.values():
        ids = kept.get(_rendering_key(record)) if "skipped" not in record else None
        if ids is not None:
            record["prompt_token_ids"], record["prompt_rendered_by"] = ids, "server"
            found += 1
    return found


def render_on_server(
    url: str,
    recorded: dict[str, dict],
    path: Path,
    gen: dict,
    model_name: str | None = None,
    health_check=None,
) -> int:
    """The server's rendering of every recorded answer's prompt that has none yet: a chat
    request for one token returns the prompt ids as the server rendered them (vLLM's
    ``return_token_ids``), which replace eaglet's and are kept in ``path``."""
    todo = [
        r
        for r in recorded.values()
        if "skipped" not in r and r.get("prompt_rendered_by") != "server"
    ]
    if not todo:
        return 0

    async def run() -> None:
        limits = httpx.Limits(max_connections=gen["concurrency"])
        async with httpx.AsyncClient(base_url=url, limits=limits) as client:
            model = await resolve_model_name(client, model_name)
            gate = asyncio.Semaphore(gen["concurrency"])
            with open(path, "a") as out:

                async def one(record: dict) -> None:
                    async with gate:
                        payload = {
                            "model": model,
                            "messages": record["messages"],
                            "max_tokens": 1,
                            "temperature": 0.0,
                            "return_token_ids": True,
                            "spaces_between_special_tokens": False,
                            **(
                                {"chat_template_kwargs": record["chat_template_kwargs"]}
                                if record.get("chat_template_kwargs")
                                else {}
                            ),
                        }
                        body = await with_retries(
                            lambda: post_json(
                                client, "/v1/chat/completions", payload, gen["request_timeout_s"]
                            ),
                            gen["max_retries"],
                            1.0,
                            health_check,
                        )
                        ids = parse_response(body)["prompt_token_ids"]
                        record["prompt_token_ids"], record["prompt_rendered_by"] = ids, "server"
                        # a capturing server saved this request's states too: not a sample's
                        saved = (body.get("kv_transfer_params") or {}).get("hidden_states_path")
                        if saved:
                            await asyncio.to_thread(discard_saved, Path(saved))
                        out.write(
                            json.dumps({"key": _rendering_key(record), "prompt_token_ids": ids})
                            + "\n"
                        )
                        out.flush()

                await gather_or_cancel([one(r) for r in todo])

    log.info("rendering the prompts of %d recorded answers on the server", len(todo))
    asyncio.run(run())
    return len(todo)


def dataset_records(
    prompts: list[dict], tokenizer, gen: dict, stop_ids: set[int], too_long
) -> dict[str, dict]:
    """The samples of every prompt with a recorded answer (too long ones recorded as skipped)."""
    records = {}
    for prompt in prompts:
        reason = too_long(build_messages(prompt, gen["system_prompt"]))
        records[prompt["id"]] = (
            {
                "id": prompt["id"],
                "source": prompt.get("source"),
                "messages": prompt["messages"],
                "skipped": reason,
            }
            if reason
            else dataset_record(prompt, tokenizer, gen, stop_ids)
        )
    return records


# -- one request -----------------------------------------------------------------------------


def build_messages(prompt: dict, system_prompt: str | None) -> list[dict]:
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
    system_prompt: str | None = None
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


# -- the stage -------------------------------------------------------------------------------


def capture_options(cfg: dict[str, Any], model_path: str, capture_dir: str) -> list[str]:
    """Server arguments that save every request's hidden states (the aux layers of
    ``extract.aux_layer_ids`` and the last layer's output) under ``capture_dir``."""

    num_layers = text_config(read_target_config(model_path))["num_hidden_layers"]
    aux = resolve_aux_layer_ids(cfg["extract"]["aux_layer_ids"], num_layers)
    Path(capture_dir).mkdir(parents=True, exist_ok=True)
    return capture_args(capture_layer_ids(aux, num_layers), Path(capture_dir).resolve())


def run_stage(
    cfg: dict[str, Any],
    target_json: str,
    prompts: dict[str, str],
    outputs: dict[str, str],
    stats_path: str,
    partial_path: str,
    progress_path: str | None,
    log_path: str | None,
    server_log_path: str,
    capture_dir: str | None = None,
) -> dict:
    """The ``generate`` rule: serve the target (or use ``server.url``), answer every prompt of
    every split (``prompts`` and ``outputs`` map a split name to its file), check the
    chat-template round trip, and write the records and their stats.

    With ``capture_dir`` (``generate.capture_hidden_states``) the server runs with the
    capture options (:mod:`eaglet.engine.capture`) and saves the hidden states of every
    answer there, named by :func:`eaglet.core.io.request_path`, for the extraction stage to pack."""
    # the partial file: a generation still running (a killed Snakemake's orphan) and its
    # rerun would append to it at once
    with hold_directory(Path(partial_path).parent, "generate"):
        return _run_stage(
            cfg,
            target_json,
            prompts,
            outputs,
            stats_path,
            partial_path,
            progress_path,
            log_path,
            server_log_path,
            capture_dir,
        )


def _run_stage(
    cfg,
    target_json,
    prompts,
    outputs,
    stats_path,
    partial_path,
    progress_path,
    log_path,
    server_log_path,
    capture_dir,
) -> dict:
    target = read_target(target_json)
    by_split = {split: read_jsonl(path) for split, path in prompts.items()}
    gen = cfg["generate"]
    tokenizer = load_tokenizer(target["path"], cfg["target"].get("trust_remote_code", False))
    too_long = too_long_check(
        tokenizer, cfg["target"]["max_model_len"], gen["chat_template_kwargs"]
    )
    # answers: dataset: the recorded answer is the sample (held-out prompts carry none)
    recorded = dataset_records(
        [p for ps in by_split.values() for p in ps if "answer" in p],
        tokenizer,
        gen,
        end_of_turn_ids(tokenizer, target["path"]),
        too_long,
    )
    everything = [
        p for split_prompts in by_split.values() for p in split_prompts if p["id"] not in recorded
    ]
    server_prompts = rendered_path(partial_path)
    if recorded:
        log.info(
            "%d prompts answered by their recorded answers (answers: dataset), %d to ask "
            "the target; %d of their prompts as the server rendered them before",
            len(recorded),
            len(everything),
            apply_server_prompts(recorded, server_prompts),
        )
    check_renderable(everything, gen["system_prompt"], tokenizer, gen["chat_template_kwargs"])
    requests = sum(len(turn_ids(p)) for p in everything)
    plan = {
        "kind": "decode",
        "servers": 1,
        "prompts": len(everything),
        "requests": requests,
        "max_tokens": gen["max_tokens"],
        "concurrency": gen["concurrency"],
    }
    progress = Progress(
        "generate", total=requests, path=progress_path, log_path=log_path, plan=plan
    )
    server_cfg = cfg["server"]
    records = drop_stale(
        read_partial(partial_path),
        answer_settings(
            Sampling.from_config(gen),
            gen["chat_template_kwargs"],
            capture_dir is not None,
            gen["system_prompt"],
        ),
    )
    if not any(turns_left(p, records) for p in everything):
        log.info("every prompt already has an answer in %s; no server needed", partial_path)
        progress.restart(already_done=requests)
    elif server_cfg["url"]:
        if capture_dir:
            raise RuntimeError(
                "generate.capture_hidden_states needs the server eaglet starts "
                "with its capture options; set server.url: null"
            )
        log.info("using the running server at %s", server_cfg["url"])
        settings = settings_from_config(cfg, server_cfg["url"].rstrip("/"))
        records = generate(everything, settings, partial_path, progress, too_long=too_long)
        render_on_server(settings.base_url, recorded, server_prompts, gen, settings.model_name)
    else:
        progress.enter_phase("starting the vLLM server")
        capture = capture_options(cfg, target["path"], capture_dir) if capture_dir else []
        per_request, seed_args = engine_seeding(cfg)
        with target_server(cfg, target["path"], server_log_path, capture + seed_args) as server:
            settings = settings_from_config(cfg, server.url)
            settings.seed_per_request = per_request
            if capture_dir:
                settings.capture_dir = str(Path(capture_dir).resolve())
            records = generate(
                everything,
                settings,
                partial_path,
                progress,
                health_check=server.check_alive,
                too_long=too_long,
            )
            render_on_server(
                server.url, recorded, server_prompts, gen, health_check=server.check_alive
            )
            if capture_dir and recorded:
                progress.enter_phase(
                    f"prefilling {len(recorded)} recorded answers for their hidden states"
                )
                prefill_recorded(
                    server.url,
                    list(recorded.values()),
                    settings.capture_dir,
                    cfg,
                    health_check=server.check_alive,
                )
                progress.enter_phase(None)
        rates.record(rates.GENERATE, target["spec"], server_start_s=server.ready_after_s)
    run = progress.report("finished")
    if run["done"] > run["resumed_from"]:
        rates.record(
            rates.GENERATE,
            target["spec"],
            settings=rates.generate_settings(cfg),
            completion_tokens_per_s=run["tokens_per_s"],
        )

    records = {**records, **recorded}
    kept = {}
    stats: dict[str, Any] = {"splits": {}, "dataset_answers": len(recorded)}
    for split, split_prompts in by_split.items():
        kept[split], stats["splits"][split] = collect(split_prompts, records, gen["keep_truncated"])
    counts = stats["splits"]
    failed = sum(c["failed"] for c in counts.values())
    if failed / max(requests, 1) > gen["max_failed_rate"]:
        failures = [f for c in counts.values() for f in c["failures"]]
        examples = "; ".join(f"{f['id']}: {f['error'][:200]}" for f in failures[:3])
        raise RuntimeError(
            f"{failed} of {requests} requests failed for good (more than "
            f"generate.max_failed_rate={gen['max_failed_rate']}): {examples}. The answers so far "
            f"are kept in {partial_path}; fix the cause and rerun to retry only the failed prompts."
        )

    fmt = answer_format(
        tokenizer,
        server_cfg["reasoning_parser"],
        end_of_turn_ids(tokenizer, target["path"]),
        gen["chat_template_kwargs"],
    )
    # the server's rendering is the prompts' reference: the ids it recorded for its answers,
    # its rendering of the recorded answers' prompts (the chat template's where it gave none)
    template = check_records(
        tokenizer,
        [r for split in kept.values() for r in split],
        fmt=fmt,
        reference=lambda r: (
            r["prompt_token_ids"]
            if r.get("model") != RECORDED_ANSWER or r.get("prompt_rendered_by") == "server"
            else None
        ),
    )
    if template["template_differs"]:
        first = template["template_first_difference"]
        log.warning(
            "the server renders %d of %d prompts otherwise than the target's chat "
            "template (first: %s, %s); training uses the server's, which serving will "
            "see",
            template["template_differs"],
            template["checked"],
            first["id"],
            first["difference"],
        )
    stats.update(
        {
            "template_check": template,
            "this_run": {
                "generated": run["done"] - run["resumed_from"],
                "failed": run["failed"],
                "resumed_from": run["resumed_from"],
                "wall_s": run["elapsed_s"],
                "requests_per_s": run["rate_per_s"],
                "completion_tokens_per_s": run["tokens_per_s"],
            },
            "sampling": Sampling.from_config(gen).settings(),
            "target": target["path"],
        }
    )
    for split, c in counts.items():
        log.info(
            "%s: %d samples (%d failed, %d truncated%s, %d too long to ask), %d completion tokens",
            split,
            c["samples"],
            c["failed"],
            c["truncated"],
            ", dropped" if c["truncated_dropped"] else "",
            c["too_long"],
            c["completion_tokens"],
        )
    log.info(
        "template check: %d of %d mismatched, %d retokenized",
        template["mismatched"],
        template["checked"],
        template["retokenized"],
    )
    enforce(template, gen["max_template_mismatch_rate"])
    for split, path in outputs.items():
        write_jsonl(path, kept[split])
    write_json(stats_path, stats)
    return stats
