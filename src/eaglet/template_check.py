"""Template round-trip check for synthetic samples.

Training sequences are built from the token ids the server saw (``prompt_token_ids``) and
emitted (``completion_token_ids``). This module re-renders each conversation as text through
the target's chat template and checks that the emitted ids are a prefix of the rendering.
A mismatch means the saved text no longer describes what the model produced: a thinking
wrapper was lost, reasoning and content were merged wrongly, or the server used a different
chat template or tokenizer than the target's.

A completion whose ids differ but whose decoded text is the same is *retokenized*, not
mismatched: models sometimes emit a non-canonical split of a string (``'|'`` then ``')``
where the tokenizer would write ``|'`` then ``)``). The ids stay the truth for training;
such samples are counted apart and do not fail the check.

Some templates (Kimi-K2.5's) open the reasoning in the generation prompt (it ends with
``<think>``) and render every assistant turn up to the last one as history, with an empty
``<think></think>``: a conversation ending in the answer renders the answer without its
reasoning, although the model emitted it. The check sees this in what the template renders
(the answer's reasoning is dropped, and the template writes a closer between the generation
prompt and the answer's content) and puts the reasoning back where the prompt opened it.
vLLM's reasoning parsers strip the whitespace that ends the reasoning; the check takes it
back from the emitted text before it calls a record mismatched.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CONTEXT_TOKENS = 4
"""Tokens of decoded context shown on each side of a mismatch."""

ENFORCE_LISTED = 5
"""Mismatching samples named in a TemplateMismatchError message."""

CONTENT_MARK = "eaglet0content0mark"
REASONING_MARK = "eaglet0reasoning0mark"
"""Stand-ins rendered to see where a template puts an answer's content and reasoning: word
characters only, which survive what templates do to them (strip whitespace, split at tags)."""


class TemplateMismatchError(RuntimeError):
    """Too many samples do not re-render through the chat template to their token ids."""


@dataclass(frozen=True)
class CheckResult:
    """Outcome of checking one record.

    ``part`` is ``"prompt"`` or ``"completion"`` on a mismatch, else None. ``first_mismatch``
    is an index into the compared sequence: ``prompt_token_ids`` for the prompt part,
    ``prompt_token_ids + completion_token_ids`` for the completion part. ``expected_len`` and
    ``rendered_len`` are the lengths of the compared sequences.
    """

    ok: bool
    reason: str
    first_mismatch: int | None
    expected_len: int
    rendered_len: int
    part: str | None = None
    retokenized: bool = False


def assistant_message(record: Mapping[str, Any]) -> dict[str, str]:
    """The assistant turn a record's answer renders as: its reasoning under both names vLLM
    hands a chat template (``reasoning_content``, which most templates read, and
    ``reasoning``)."""
    message = {"role": "assistant", "content": record.get("content") or ""}
    reasoning = record.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        message["reasoning_content"] = reasoning
        message["reasoning"] = reasoning
    return message


def render_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of ``messages`` rendered through the tokenizer's chat template, with the
    template variables the server rendered them with (``generate.chat_template_kwargs``).

    transformers 5.x returns a BatchEncoding from ``tokenize=True`` by default; 4.x returns
    a list. ``return_dict=False`` is passed, and a mapping is still unwrapped to be safe.
    """
    result = tokenizer.apply_chat_template(
        list(messages),
        tokenize=True,
        add_generation_prompt=add_generation_prompt,
        return_dict=False,
        **dict(template_kwargs or {}),
    )
    if isinstance(result, Mapping):
        result = result["input_ids"]
    return [int(token) for token in result]


def render_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """``messages`` rendered through the chat template as text (what :func:`render_ids`
    tokenizes)."""
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
        **dict(template_kwargs or {}))


def text_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of rendered text, tokenized as ``apply_chat_template`` tokenizes it."""
    return [int(token) for token in tokenizer(text, add_special_tokens=False)["input_ids"]]


def answer_opening(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    template_kwargs: Mapping[str, Any] | None = None,
    reasoning: str | None = None,
    prompt: str | None = None,
) -> str | None:
    """The text the chat template writes between the generation prompt and the content of an
    answer to ``messages`` (with ``reasoning``, if given).

    ``""`` for a plain template; ``"</think>"`` for one whose generation prompt opens the
    reasoning with ``<think>`` and that renders the answer with an empty reasoning (so a model
    answering without reasoning emits it first). None when the conversation with an answer
    does not begin with the generation prompt, or the content is not rendered verbatim.
    ``prompt`` is the generation prompt's text, when the caller has it.
    """
    if prompt is None:
        prompt = render_text(tokenizer, messages, True, template_kwargs)
    answer = {"role": "assistant", "content": CONTENT_MARK}
    if reasoning:
        answer |= {"reasoning_content": reasoning, "reasoning": reasoning}
    text = render_text(tokenizer, [*messages, answer], False, template_kwargs)
    if not text.startswith(prompt):
        return None
    opening, found, _ = text[len(prompt):].partition(CONTENT_MARK)
    return opening if found else None


def reopened_text(tokenizer: PreTrainedTokenizerBase, record: Mapping[str, Any]) -> str | None:
    """The conversation's text with the answer's reasoning where the model emitted it, for a
    template that opens the reasoning in the generation prompt and renders this answer
    without it (as history, with an empty wrapper); None for any other template.

    Decided from what the template renders: the answer's reasoning is dropped (the opening
    is the same with and without it), and the template closes something between the
    generation prompt and the content (the opening is not empty). The reasoning then goes
    right after the generation prompt, before that closer, as the model wrote it there.
    """
    reasoning = record.get("reasoning")
    if not isinstance(reasoning, str) or not reasoning:
        return None
    messages, kwargs = record["messages"], record.get("chat_template_kwargs")
    prompt = render_text(tokenizer, messages, True, kwargs)
    closer = answer_opening(tokenizer, messages, kwargs, prompt=prompt)
    if not closer or answer_opening(tokenizer, messages, kwargs, REASONING_MARK, prompt) != closer:
        return None
    text = render_text(tokenizer, [*messages, assistant_message(record)], False, kwargs)
    if not text.startswith(prompt + closer):
        return None
    return prompt + reasoning + text[len(prompt):]


def render_conversation_ids(
    tokenizer: PreTrainedTokenizerBase, record: Mapping[str, Any]
) -> list[int]:
    """Token ids of the record's messages followed by its assistant answer, with the answer's
    reasoning where the model emitted it (see :func:`reopened_text`)."""
    reopened = reopened_text(tokenizer, record)
    if reopened is not None:
        return text_ids(tokenizer, reopened)
    messages = [*record["messages"], assistant_message(record)]
    return render_ids(tokenizer, messages, add_generation_prompt=False,
                      template_kwargs=record.get("chat_template_kwargs"))


def with_emitted_reasoning_end(
    tokenizer: PreTrainedTokenizerBase, record: Mapping[str, Any]
) -> Mapping[str, Any] | None:
    """The record with the whitespace that followed its reasoning in the emitted text put
    back; None when the reasoning is not in the emitted text or no whitespace followed it.

    vLLM's reasoning parsers strip it: a newline before ``</think>`` is in the ids but not
    in the reasoning, and a reasoning cut at max_tokens loses its last newlines. The ids
    stay the truth; this only keeps such records from counting as mismatched."""
    reasoning = record.get("reasoning")
    if not isinstance(reasoning, str) or not reasoning:
        return None
    emitted = tokenizer.decode(list(record["completion_token_ids"]), skip_special_tokens=False)
    start = emitted.find(reasoning)
    if start < 0:
        return None
    space = re.match(r"\s*", emitted[start + len(reasoning):]).group()
    return {**record, "reasoning": reasoning + space} if space else None


def first_difference(expected: Sequence[int], rendered: Sequence[int]) -> int | None:
    """First index where ``expected`` is not matched by ``rendered``; None if it is a prefix."""
    for index, token in enumerate(expected):
        if index >= len(rendered) or rendered[index] != token:
            return index
    return None


def describe_at(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], index: int) -> str:
    """Decoded tokens around ``index`` with the token at ``index`` shown as ``[id 'token']``."""
    before = tokenizer.decode(ids[max(0, index - CONTEXT_TOKENS) : index])
    after = tokenizer.decode(ids[index + 1 : index + 1 + CONTEXT_TOKENS])
    if index < len(ids):
        token = f"[{ids[index]} {tokenizer.convert_ids_to_tokens(ids[index])!r}]"
    else:
        token = "[end]"
    return f"...{before!r} {token} {after!r}..."


def mismatch(
    tokenizer: PreTrainedTokenizerBase,
    part: str,
    expected: Sequence[int],
    rendered: Sequence[int],
    index: int,
) -> CheckResult:
    reason = (
        f"{part} differs at token {index} "
        f"(expected {len(expected)} tokens, template renders {len(rendered)}): "
        f"expected {describe_at(tokenizer, expected, index)}, "
        f"template renders {describe_at(tokenizer, rendered, index)}"
    )
    return CheckResult(False, reason, index, len(expected), len(rendered), part)


def check_record(tokenizer: PreTrainedTokenizerBase, record: Mapping[str, Any]) -> CheckResult:
    """Check the prompt renders to ``prompt_token_ids`` and the emitted ids prefix the conversation.

    Only a prefix match is required of the whole conversation: the template may append tokens
    after the end-of-turn token, and a truncated sample has no end-of-turn at all. A rendering
    shorter than the emitted ids fails. A completion that differs is rendered once more with
    the whitespace the reasoning parser stripped from the end of the reasoning put back.
    """
    prompt = list(record["prompt_token_ids"])
    rendered_prompt = render_ids(tokenizer, record["messages"], add_generation_prompt=True,
                                 template_kwargs=record.get("chat_template_kwargs"))
    if rendered_prompt != prompt:
        index = first_difference(prompt, rendered_prompt)
        if index is None:  # the template appends tokens after what the server fed the model
            index = len(prompt)
        return mismatch(tokenizer, "prompt", prompt, rendered_prompt, index)

    emitted = prompt + list(record["completion_token_ids"])
    rendered = render_conversation_ids(tokenizer, record)
    index = first_difference(emitted, rendered)
    if index is not None and index >= len(prompt):
        restored = with_emitted_reasoning_end(tokenizer, record)
        if restored is not None:  # the parser stripped whitespace the model emitted
            again = render_conversation_ids(tokenizer, restored)
            later = first_difference(emitted, again)
            if later is None or later > index:  # report what the whitespace did not explain
                rendered, index = again, later
    if index is None:
        return CheckResult(True, "", None, len(emitted), len(rendered))
    part = "prompt" if index < len(prompt) else "completion"
    result = mismatch(tokenizer, part, emitted, rendered, index)
    if part == "completion" and same_text(tokenizer, emitted, rendered):
        return CheckResult(True, result.reason, index, len(emitted), len(rendered),
                           part, retokenized=True)
    return result


def same_text(tokenizer: PreTrainedTokenizerBase, emitted: Sequence[int],
              rendered: Sequence[int]) -> bool:
    """Whether the emitted ids decode to a prefix of the rendered conversation's text."""
    return tokenizer.decode(rendered).startswith(tokenizer.decode(emitted))


def check_records(
    tokenizer: PreTrainedTokenizerBase,
    records: Iterable[Mapping[str, Any]],
    max_listed: int = 20,
) -> dict[str, Any]:
    """Check every record; list the first ``max_listed`` mismatches."""
    checked = 0
    mismatches: list[dict[str, Any]] = []
    retokenized: list[dict[str, Any]] = []
    for record in records:
        checked += 1
        result = check_record(tokenizer, record)
        if result.ok and not result.retokenized:
            continue
        entry = {"id": record.get("id"), "part": result.part,
                 "index": result.first_mismatch, "reason": result.reason}
        (retokenized if result.retokenized else mismatches).append(entry)
    return {
        "checked": checked,
        "mismatched": len(mismatches),
        "mismatch_rate": len(mismatches) / checked if checked else 0.0,
        "mismatches": mismatches[:max_listed],
        "retokenized": len(retokenized),
        "retokenized_examples": retokenized[:max_listed],
    }


def enforce(report: Mapping[str, Any], max_rate: float) -> None:
    """Raise TemplateMismatchError when the report's mismatch rate exceeds ``max_rate``."""
    rate = report["mismatch_rate"]
    if rate <= max_rate:
        return
    examples = "\n".join(
        f"  {entry['id']} ({entry['part']}): {entry['reason']}"
        for entry in report["mismatches"][:ENFORCE_LISTED]
    )
    raise TemplateMismatchError(
        f"{report['mismatched']} of {report['checked']} samples ({rate:.2%}) do not re-render "
        f"through the target's chat template to their token ids; the threshold is "
        f"{max_rate:.2%}.\nFirst mismatches:\n{examples}\n"
        "Check that the server used the target's chat template (its tokenizer_config.json "
        "chat_template, not a --chat-template override), that the reasoning parser matches the "
        "model and the template renders reasoning from the assistant key 'reasoning_content', "
        "and that the server and eaglet use the same tokenizer (and tokenizers/transformers "
        "versions). To accept more mismatches, raise generate.max_template_mismatch_rate."
    )
