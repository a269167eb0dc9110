"""Check that every synthetic sample is what training takes it for.

Training sequences are the token ids the server saw (``prompt_token_ids``) and emitted
(``completion_token_ids``); the text fields (``reasoning``, ``content``) are what the server's
reasoning parser made of the emitted ids. The check establishes exactly what training relies
on, for any chat template and any reasoning format:

* **the prompt** is what the server renders for the messages with the generation prompt
  (and the request's template variables): vLLM records the ids it rendered, and the server,
  not the chat template, is what serving will use (vLLM renders gpt-oss through the harmony
  encoding, not its template). Where no server rendering is at hand, the target's chat
  template is the reference: another template or tokenizer then shows as a mismatch. Where
  the server and the chat template disagree, the check counts it and says where, once;
* **the completion** holds the parser's reasoning and then its content, in that order, in the
  text its ids decode to, separated and surrounded by nothing but the format's wrappers (the
  reasoning's opener and closer, a channel's name, the end of turn), with the reasoning's
  closer between them and its opener before it (in the completion, or still open at the end
  of the prompt) where the parser names its markers (vLLM's ``reasoning_start_str`` and
  ``reasoning_end_str``: ``<think>``/``</think>``, Gemma 4's ``<|channel>``/``<channel|>``);
  and no id follows the first end of turn of a finished answer.

Nothing is modelled per template family. How a template renders an answer *as history* (an
empty ``<think></think>``, the reasoning dropped, the turn skipped) does not matter: the model
never reads its own answer that way while it writes it. What breaks the check is what breaks
training: a server on another template (the prompt differs), a lost wrapper token (no closer
between reasoning and content), a different tokenizer (the text is not in the ids), text fields
that do not describe their ids (reasoning merged into the content, content saved as reasoning).

Ids whose text is right but whose split is not the tokenizer's own (a model may emit ``'|'``
then ``')'`` where the tokenizer writes ``'|'`` ``')'`` merged) are *retokenized*: counted
apart, not mismatched; the ids stay the truth for training.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("eaglet.data.template_check")

CONTEXT_TOKENS = 4
"""Tokens of decoded context shown on each side of a mismatch."""

ENFORCE_LISTED = 5
"""Mismatching samples named in a TemplateMismatchError message."""

WRAPPER_TOKENS = 32
"""The most tokens a wrapper (before the reasoning, between reasoning and content, after the
content) may hold: formats write a few (``<think>\\n``, ``\\n</think>\\n\\n``,
``<|channel>thought\\n``, an end of turn); more is text the fields do not account for."""

CONTENT_MARK = "eaglet0content0mark"
"""A stand-in rendered to see where a template puts an answer's content: word characters
only, which survive what templates do to them (strip whitespace, split at tags)."""


class TemplateMismatchError(RuntimeError):
    """Too many samples are not what training takes them for."""


@dataclass(frozen=True)
class AnswerFormat:
    """What the run's server does with an answer: whether a reasoning parser splits it, the
    parser's markers where it names them, and the ids a finished answer ends at."""

    parser: str | None = None
    opener: str | None = None
    closer: str | None = None
    stop_ids: frozenset[int] = field(default_factory=frozenset)


def answer_format(
    tokenizer: PreTrainedTokenizerBase,
    parser: str | None,
    stop_ids: Iterable[int] = (),
    template_kwargs: Mapping[str, Any] | None = None,
) -> AnswerFormat:
    """The run's :class:`AnswerFormat`: the markers are asked of vLLM's own parser ``parser``
    (``server.reasoning_parser``), built on the target's tokenizer as the server builds it.
    Where vLLM is not importable, or the parser names no markers (a format of plain text
    phrases, or one parsed from ids), the check keeps to the text's structure."""
    stops = frozenset(int(i) for i in stop_ids) | frozenset({tokenizer.eos_token_id} - {None})
    if not parser:
        return AnswerFormat(None, None, None, stops)
    opener = closer = None
    try:
        from vllm.reasoning import ReasoningParserManager

        built = ReasoningParserManager.get_reasoning_parser(parser)(
            tokenizer, chat_template_kwargs=dict(template_kwargs or {})
        )
        opener, closer = built.reasoning_start_str, built.reasoning_end_str
    except Exception as error:  # the markers refine the check; without them it still holds
        log.warning(
            "the reasoning parser %s could not be asked for its markers (%s: %s): the "
            "template check compares the text's structure only",
            parser,
            type(error).__name__,
            error,
        )
    return AnswerFormat(parser, opener or None, closer or None, stops)


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
    template_differs: str | None = None


REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
"""The names chat templates read an assistant message's reasoning under: vLLM hands a template
``reasoning_content`` (which most read) and ``reasoning``; gpt-oss's template reads
``thinking``. A message carries it under every one, and each template reads the one it knows."""


def with_reasoning(message: dict[str, str], reasoning: str | None) -> dict[str, str]:
    """``message`` with ``reasoning`` under every name of :data:`REASONING_FIELDS`."""
    if isinstance(reasoning, str) and reasoning:
        message = {**message, **{name: reasoning for name in REASONING_FIELDS}}
    return message


def assistant_message(record: Mapping[str, Any]) -> dict[str, str]:
    """The assistant turn a record's answer is as a message of a later turn, its reasoning
    under every name templates read it by (:data:`REASONING_FIELDS`)."""
    return with_reasoning(
        {"role": "assistant", "content": record.get("content") or ""}, record.get("reasoning")
    )


def render_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of ``messages`` rendered through the tokenizer's chat template, with the
    template variables the server rendered them with (``generate.chat_template_kwargs``).
    A conversation that ends with an answer is rendered as :func:`render_answered` does.

    transformers 5.x returns a BatchEncoding from ``tokenize=True`` by default; 4.x returns
    a list. ``return_dict=False`` is passed, and a mapping is still unwrapped to be safe.
    """
    return _ids(_render(tokenizer, messages, add_generation_prompt, template_kwargs, True)[0])


def render_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """``messages`` rendered through the chat template as text (what :func:`render_ids`
    tokenizes)."""
    return _render(tokenizer, messages, add_generation_prompt, template_kwargs, False)[0]


def render_answered(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    template_kwargs: Mapping[str, Any] | None = None,
    tokenize: bool = True,
) -> tuple[list[int] | str, bool]:
    """A conversation that ends with an answer (an assistant turn), rendered, and whether
    the rendering ends the answer's turn as the renderer ends a turn.

    A chat template renders the answer as a finished turn. A renderer that serves only
    (mistral_common, which vLLM renders Mistral's own format with) refuses a conversation
    that ends with an assistant turn, unless it is an answer in progress: vLLM's chat API
    renders it so where a request asks to continue its final message
    (``continue_final_message``), and so is it rendered here, without an end of turn (False):
    the caller ends it with the id the target stops at, as a model ends its answer."""
    rendered, ended = _render(tokenizer, messages, False, template_kwargs, tokenize)
    return (_ids(rendered) if tokenize else rendered), ended


def _render(tokenizer, messages, add_generation_prompt, template_kwargs, tokenize):
    options = {"tokenize": tokenize, "add_generation_prompt": add_generation_prompt}
    if tokenize:
        options["return_dict"] = False
    options |= dict(template_kwargs or {})
    try:
        return tokenizer.apply_chat_template(list(messages), **options), True
    except Exception as refused:
        answer_last = bool(messages) and messages[-1].get("role") == "assistant"
        if add_generation_prompt or not answer_last:
            raise
        try:
            continued = tokenizer.apply_chat_template(
                list(messages), **options, continue_final_message=True
            )
        except Exception:
            raise refused from None
        return continued, False


def _ids(result) -> list[int]:
    if isinstance(result, Mapping):
        result = result["input_ids"]
    return [int(token) for token in result]


def text_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of rendered text, tokenized as ``apply_chat_template`` tokenizes it: the
    text of a special token (``<|im_end|>``, ``[THINK]``) is that token. A tokenizer that
    never reads text as a special token (Tekken, where ``</s>`` as text is four plain
    tokens: its renderer puts special tokens in by id) gets them by id here too."""
    specials = _unread_specials(tokenizer)
    if not specials:
        return _plain_ids(tokenizer, text)
    ids: list[int] = []
    for i, piece in enumerate(specials["pattern"].split(text)):
        if i % 2:
            ids.append(specials["ids"][piece])
        elif piece:
            ids += _plain_ids(tokenizer, piece)
    return ids


def _plain_ids(tokenizer, text: str) -> list[int]:
    return [int(token) for token in tokenizer(text, add_special_tokens=False)["input_ids"]]


_UNREAD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _unread_specials(tokenizer) -> dict | None:
    """The special tokens of a tokenizer that does not read their text as them (None where it
    does, as transformers' own tokenizers do): their ids by text, and a pattern that splits
    text at them, longest first."""
    try:
        return _UNREAD[tokenizer]
    except KeyError:
        pass
    except TypeError:  # a tokenizer class that cannot be a weak key: asked every time
        return _specials_by_id(tokenizer)
    _UNREAD[tokenizer] = found = _specials_by_id(tokenizer)
    return found


def _specials_by_id(tokenizer) -> dict | None:
    names = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
    by_text = {name: tokenizer.convert_tokens_to_ids(name) for name in names}
    by_text = {name: int(i) for name, i in by_text.items() if i is not None}
    eos = tokenizer.eos_token
    if not (eos in by_text and _plain_ids(tokenizer, eos) != [by_text[eos]]):
        return None
    longest_first = sorted(by_text, key=len, reverse=True)
    return {
        "ids": by_text,
        "pattern": re.compile("(" + "|".join(re.escape(n) for n in longest_first) + ")"),
    }


def answer_opening(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    template_kwargs: Mapping[str, Any] | None = None,
    reasoning: str | None = None,
    prompt: str | None = None,
) -> str | None:
    """The text the chat template writes between the generation prompt and the content of an
    answer to ``messages`` (with ``reasoning``, if given), rendered as the last turn.

    ``""`` for a plain template; ``"</think>"`` for one whose generation prompt opens the
    reasoning with ``<think>`` and that renders the answer with an empty reasoning. None when
    the conversation with an answer does not begin with the generation prompt, or the content
    is not rendered verbatim. ``prompt`` is the generation prompt's text, when the caller has
    it."""
    if prompt is None:
        prompt = render_text(tokenizer, messages, True, template_kwargs)
    answer = with_reasoning({"role": "assistant", "content": CONTENT_MARK}, reasoning)
    text = render_answered(tokenizer, [*messages, answer], template_kwargs, tokenize=False)[0]
    if not text.startswith(prompt):
        return None
    opening, found, _ = text[len(prompt) :].partition(CONTENT_MARK)
    return opening if found else None


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


# -- the completion --------------------------------------------------------------------------


@dataclass
class Completion:
    """A record's completion as text: the text its ids decode to (special tokens kept) and
    the ids, with the means to find the token at a character position."""

    tokenizer: Any
    ids: list[int]
    text: str

    def token_at(self, char: int) -> int:
        """The index of the token whose text holds character ``char`` (the first token past
        the text at its end): the fewest tokens whose decoding reaches past ``char``."""
        lo, hi = 0, len(self.ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.tokenizer.decode(self.ids[: mid + 1], skip_special_tokens=False)) > char:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def tokens(self, text: str) -> int:
        return len(text_ids(self.tokenizer, text)) if text.strip() else 0


def _find(text: str, needle: str, start: int) -> tuple[int, int]:
    """Where ``needle`` is in ``text`` from ``start`` on: (its start, -1); where it is not,
    (-1, the character where the longest match of its beginning, begun within a wrapper's
    reach of ``start``, stops)."""
    at = text.find(needle, start)
    if at >= 0:
        return at, -1
    best_end, best = start, -1
    for begin in range(start, min(len(text), start + 4 * WRAPPER_TOKENS) + 1):
        length = 0
        while (
            length < len(needle)
            and begin + length < len(text)
            and text[begin + length] == needle[length]
        ):
            length += 1
        if length > best:
            best, best_end = length, begin + length
    return -1, best_end


def _special_only(tokenizer, text: str) -> bool:
    """Whether ``text`` is whitespace and special tokens only (what a server without a
    reasoning parser leaves out of the content: vLLM skips special tokens)."""
    return not tokenizer.decode(text_ids(tokenizer, text), skip_special_tokens=True).strip()


def check_completion(
    tokenizer: PreTrainedTokenizerBase, record: Mapping[str, Any], fmt: AnswerFormat
) -> tuple[str, int] | None:
    """Why the record's completion ids are not its text fields with the format's wrappers
    (module doc), and the index into the completion's ids where it shows; None when they are."""
    ids = [int(i) for i in record["completion_token_ids"]]
    done = fmt.stop_ids and record.get("finish_reason") == "stop"
    stop = next((k for k, i in enumerate(ids) if i in fmt.stop_ids), None) if done else None
    if stop is not None and stop < len(ids) - 1:
        return (
            f"ids follow the end of turn at completion token {stop}: the server stops at its first",
            stop + 1,
        )
    body = ids[:stop] if stop is not None else ids
    text = tokenizer.decode(body, skip_special_tokens=False)
    if record.get("finish_reason") == "length":
        # cut by max_tokens inside a character: its first bytes decode to replacement
        # characters, which the server's text leaves out
        text = text.rstrip("\ufffd")
    answer = Completion(tokenizer, body, text)
    reasoning = (record.get("reasoning") or "").strip()
    content = (record.get("content") or "").strip()
    if reasoning and not fmt.parser:
        return "the record has a reasoning, but the run has no reasoning parser", 0
    if fmt.opener and fmt.closer:
        found = _by_markers(
            answer.text, _opened_by_prompt(tokenizer, record, fmt), fmt, reasoning, content
        )
    else:
        found = _by_position(answer, tokenizer, fmt, reasoning, content)
    return None if found is None else (found[0], answer.token_at(found[1]))


def _by_position(
    answer: Completion, tokenizer, fmt: AnswerFormat, reasoning: str, content: str
) -> tuple[str, int] | None:
    """A format whose markers the parser does not name (or no parser): the reasoning, then
    the content, found in the text in that order, and around them wrappers only (a few
    tokens; without a parser nothing but special tokens, which the server leaves out)."""
    cursor, wrappers = 0, []
    for name, value in (("reasoning", reasoning), ("content", content)):
        if not value:
            continue
        at, stops = _find(answer.text, value, cursor)
        if at < 0:
            return (
                f"the answer's {name} is not in the text its ids decode to: they part at "
                f"character {stops - cursor} of it",
                stops,
            )
        wrappers.append((name, answer.text[cursor:at], cursor))
        cursor = at + len(value)
    wrappers.append(("end", answer.text[cursor:], cursor))
    for name, text, at in wrappers:
        where = {
            "reasoning": "before the reasoning",
            "content": "before the content",
            "end": "after the answer",
        }[name]
        if answer.tokens(text) > WRAPPER_TOKENS:
            return (
                f"{answer.tokens(text)} tokens {where} that the text fields do not hold "
                f"(a wrapper is at most {WRAPPER_TOKENS})",
                at,
            )
        if not fmt.parser and text.strip() and not _special_only(tokenizer, text):
            return (
                f"text {where} that the content lacks ({text.strip()[:40]!r}): without a "
                f"reasoning parser the server's content is the whole answer",
                at,
            )
    if reasoning and content and not wrappers[1][1].strip():
        return (
            "nothing between the reasoning and the content: the wrapper that closed the "
            "reasoning is not in the ids",
            wrappers[1][2],
        )
    return None


def _by_markers(
    text: str, opened: bool, fmt: AnswerFormat, reasoning: str, content: str
) -> tuple[str, int] | None:
    """A format whose markers the parser names: the text cut at them, from the prompt's state
    on (a reasoning the generation prompt opened is open at the answer's start), holds the
    reasoning inside them and the content outside, each the field the parser gave, whitespace
    aside (parsers strip it) and a channel's name aside (a word alone on a block's first line:
    Gemma's ``thought``). A reasoning the ids hold and the record lacks, content saved as
    reasoning, a lost closer, another tokenizer's text: each parts from its field."""
    spans = _marker_spans(text, opened, fmt)
    for name, want, inside in (("reasoning", reasoning, True), ("content", content, False)):
        mine = [(a, b) for kind, a, b in spans if kind == inside]
        parted = _parts(text, mine, want)
        if parted is not None and inside:
            later = _parts(text, [_unnamed(text, a, b) for a, b in mine], want)
            if later is None:
                continue
            parted = max(parted, later)
        if parted is not None:
            where = (
                f"between {fmt.opener!r} and {fmt.closer!r}"
                if inside
                else f"outside {fmt.opener!r}...{fmt.closer!r}"
            )
            held = "".join(text[a:b] for a, b in mine).strip()
            if not want:
                return (
                    f"a {name} in the ids ({held[:40]!r}, {where}) that the record lacks",
                    parted,
                )
            if not held:
                return f"the record's {name} is not in the ids: nothing {where}", parted
            return (
                f"the answer's {name} is not what its ids hold {where}: they part at "
                f"character {parted} of the answer",
                parted,
            )
    return None


def _marker_spans(text: str, opened: bool, fmt: AnswerFormat) -> list[tuple[bool, int, int]]:
    """The text between the markers, in order: (inside a reasoning, start, end)."""
    spans, at, state = [], 0, opened
    while True:
        found = [(text.find(m, at), m) for m in (fmt.opener, fmt.closer)]
        found = [(i, m) for i, m in found if i >= 0]
        end = min(found)[0] if found else len(text)
        spans.append((state, at, end))
        if not found:
            return spans
        marker = min(found)[1]
        state = marker == fmt.opener
        at = end + len(marker)


def _unnamed(text: str, a: int, b: int) -> tuple[int, int]:
    """A reasoning block without its channel's name: a word alone on its first line."""
    line, newline, _ = text[a:b].partition("\n")
    return (a + len(line) + 1, b) if newline and line.strip().isalnum() else (a, b)


def _parts(text: str, spans: list[tuple[int, int]], want: str) -> int | None:
    """Where the text of ``spans`` (joined) and ``want`` first differ, whitespace aside, as a
    character of ``text``; None where they are the same."""
    letters = iter(c for c in want if not c.isspace())
    last = 0
    for a, b in spans:
        for index in range(a, b):
            if text[index].isspace():
                continue
            if next(letters, None) != text[index]:
                return index
            last = index + 1
    return None if next(letters, None) is None else last


def _opened_by_prompt(tokenizer, record: Mapping[str, Any], fmt: AnswerFormat) -> bool:
    """Whether the generation prompt ends inside a reasoning (its last opener after its last
    closer): then the model's answer begins in it."""
    text = tokenizer.decode(list(record["prompt_token_ids"]), skip_special_tokens=False)
    return text.rfind(fmt.opener) > text.rfind(fmt.closer)


def template_difference(
    tokenizer: PreTrainedTokenizerBase, record: Mapping[str, Any], reference: Sequence[int]
) -> tuple[list[int] | None, str | None]:
    """The chat template's rendering of the record's prompt, and where it differs from the
    ``reference`` rendering (the server's), in words; (None, why) where the template cannot
    render it."""
    try:
        template = render_ids(
            tokenizer,
            record["messages"],
            add_generation_prompt=True,
            template_kwargs=record.get("chat_template_kwargs"),
        )
    except Exception as error:  # a template the server does not use may not render at all
        return None, f"the chat template cannot render it ({type(error).__name__}: {error})"
    if template == list(reference):
        return template, None
    index = first_difference(reference, template)
    index = len(reference) if index is None else index
    return template, (
        f"prompt token {index} of {len(reference)}: the server renders "
        f"{describe_at(tokenizer, reference, index)}, the chat template "
        f"{describe_at(tokenizer, template, index)}"
    )


def check_record(
    tokenizer: PreTrainedTokenizerBase,
    record: Mapping[str, Any],
    fmt: AnswerFormat | None = None,
    reference: Sequence[int] | None = None,
) -> CheckResult:
    """Check one record (module doc): its prompt against the reference rendering of its
    messages, its completion against its text fields and the run's answer format ``fmt``
    (None: a server without a reasoning parser, stopping at the tokenizer's eos).

    ``reference`` is the server's rendering of the messages where the caller has it: vLLM
    does not always render with the chat template (gpt-oss prompts go through the harmony
    encoding, which writes a system prompt, a date and template variables its own way), and
    what the server renders is what serving will see. The chat template's rendering is then
    compared too, and where it differs the result says where (``template_differs``): a fact
    to report, not a fault of the sample. Without a reference, the chat template's rendering
    is the reference."""
    fmt = fmt or answer_format(tokenizer, None)
    prompt = list(record["prompt_token_ids"])
    differs = None
    if reference is None:
        rendered_prompt = render_ids(
            tokenizer,
            record["messages"],
            add_generation_prompt=True,
            template_kwargs=record.get("chat_template_kwargs"),
        )
    else:
        rendered_prompt = list(reference)
        differs = template_difference(tokenizer, record, rendered_prompt)[1]
    if rendered_prompt != prompt:
        index = first_difference(prompt, rendered_prompt)
        if index is None:  # the template appends tokens after what the server fed the model
            index = len(prompt)
        return replace(
            mismatch(tokenizer, "prompt", prompt, rendered_prompt, index), template_differs=differs
        )
    emitted = prompt + list(record["completion_token_ids"])
    problem = check_completion(tokenizer, record, fmt)
    if problem is not None:
        why, index = problem
        index += len(prompt)
        reason = (
            f"completion differs at token {index}: {why}: {describe_at(tokenizer, emitted, index)}"
        )
        return CheckResult(
            False, reason, index, len(emitted), len(emitted), "completion", template_differs=differs
        )
    completion = list(record["completion_token_ids"])
    text = tokenizer.decode(completion, skip_special_tokens=False)
    canonical = text_ids(tokenizer, text)
    if canonical != completion:  # the same text, split otherwise than the tokenizer splits it
        index = len(prompt) + (first_difference(completion, canonical) or 0)
        return CheckResult(
            True,
            f"completion ids split their text otherwise than the tokenizer at token {index}",
            index,
            len(emitted),
            len(prompt) + len(canonical),
            "completion",
            retokenized=True,
            template_differs=differs,
        )
    return CheckResult(True, "", None, len(emitted), len(emitted), template_differs=differs)


def check_records(
    tokenizer: PreTrainedTokenizerBase,
    records: Iterable[Mapping[str, Any]],
    max_listed: int = 20,
    fmt: AnswerFormat | None = None,
    reference: Callable[[Mapping[str, Any]], Sequence[int] | None] | None = None,
) -> dict[str, Any]:
    """Check every record; list the first ``max_listed`` mismatches. ``reference(record)``
    gives the server's rendering of a record's prompt where the caller has it
    (:func:`check_record`); the records whose chat-template rendering differs from it are
    counted (``template_differs``) with the first difference."""
    fmt = fmt or answer_format(tokenizer, None)
    checked = 0
    mismatches: list[dict[str, Any]] = []
    retokenized: list[dict[str, Any]] = []
    differs, first_difference_seen = 0, None
    for record in records:
        checked += 1
        result = check_record(
            tokenizer, record, fmt, reference(record) if reference is not None else None
        )
        if result.template_differs:
            differs += 1
            first_difference_seen = first_difference_seen or {
                "id": record.get("id"),
                "difference": result.template_differs,
            }
        if result.ok and not result.retokenized:
            continue
        entry = {
            "id": record.get("id"),
            "part": result.part,
            "index": result.first_mismatch,
            "reason": result.reason,
        }
        (retokenized if result.retokenized else mismatches).append(entry)
    return {
        "checked": checked,
        "mismatched": len(mismatches),
        "mismatch_rate": len(mismatches) / checked if checked else 0.0,
        "mismatches": mismatches[:max_listed],
        "retokenized": len(retokenized),
        "retokenized_examples": retokenized[:max_listed],
        "template_differs": differs,
        "template_first_difference": first_difference_seen,
        "format": {"reasoning_parser": fmt.parser, "opener": fmt.opener, "closer": fmt.closer},
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
        f"{report['mismatched']} of {report['checked']} samples ({rate:.2%}) are not what "
        f"training takes them for (prompt ids = the target's chat template rendering; "
        f"completion ids = the text fields in their wrappers); the threshold is "
        f"{max_rate:.2%}.\nFirst mismatches:\n{examples}\n"
        "A prompt mismatch: the server used another chat template (a --chat-template override, "
        "other template variables) or another tokenizer than the target's. A completion "
        "mismatch: server.reasoning_parser does not fit the model's output (the parser must "
        "split what the model emits, e.g. 'reasoning_content' and its wrapper tokens), or the "
        "server and eaglet use different tokenizers (or tokenizers/transformers versions). To "
        "accept more mismatches, raise generate.max_template_mismatch_rate."
    )
