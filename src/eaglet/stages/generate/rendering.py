"""What a prompt renders to through the target's tokenizer and chat template, and the
recorded answers (``answers: dataset``).

Before any server starts: the target's tokenizer, the check that every prompt renders, and the
check that leaves a prompt too long for ``target.max_model_len`` unasked. Then the samples of
prompts whose recorded answer is the answer, rendered as the server renders a conversation, and
the server's own rendering of their prompts (kept beside the partial file).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from eaglet.core.io import read_jsonl
from eaglet.data.prompts import RECORDED_ANSWER
from eaglet.data.template_check import answer_opening, render_answered, render_ids
from eaglet.engine.client import gather_or_cancel, post_json, with_retries
from eaglet.engine.support import mistral_mode
from eaglet.stages.generate.run import (
    build_messages,
    discard_saved,
    parse_response,
    resolve_model_name,
)

log = logging.getLogger("eaglet.stages.generate")


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
    system_prompt: str | list | None,
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
    (``target.trust_remote_code``; the server gets the same setting); mistral_common's where
    vLLM serves the target in its Mistral mode, or will (:func:`mistral_mode`). A tokenizer that is
    code shipped with the model (``auto_map`` in tokenizer_config.json, a tokenization_*.py:
    Kimi's tiktoken tokenizer) fails without it, with the setting named."""
    if mistral_mode(path) is not False:
        # Mistral's own format: vLLM renders with mistral_common's tokenizer, whatever the
        # config beside it says (tokenizers/registry.py), and so does eaglet
        from transformers import MistralCommonBackend

        return MistralCommonBackend.from_pretrained(path)
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
    whole, ended = render_answered(
        tokenizer, [*messages, {"role": "assistant", "content": prompt["answer"]}], kwargs
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
    elif not ended:  # rendered as an answer in progress: the target ends it with its stop id
        answer = [*answer, min(stop_ids)]
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
