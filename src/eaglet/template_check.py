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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CONTEXT_TOKENS = 4
"""Tokens of decoded context shown on each side of a mismatch."""

ENFORCE_LISTED = 5
"""Mismatching samples named in a TemplateMismatchError message."""


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
    """The assistant turn a record's answer renders as, reasoning under ``reasoning_content``."""
    message = {"role": "assistant", "content": record.get("content") or ""}
    reasoning = record.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        message["reasoning_content"] = reasoning
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


def render_conversation_ids(
    tokenizer: PreTrainedTokenizerBase, record: Mapping[str, Any]
) -> list[int]:
    """Token ids of the record's messages followed by its assistant answer."""
    messages = [*record["messages"], assistant_message(record)]
    return render_ids(tokenizer, messages, add_generation_prompt=False,
                      template_kwargs=record.get("chat_template_kwargs"))


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
    shorter than the emitted ids fails.
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
