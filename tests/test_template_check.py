"""The synthetic-sample check on a tiny byte-level tokenizer: prompts against the template's
rendering, completions against their text fields and the run's answer format, on ChatML
templates shaped like Qwen3's and Kimi-K2.5's (the four real families are rehearsed end to
end: tests/test_rehearse.py)."""

from __future__ import annotations

import re

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from eaglet.data.template_check import (
    AnswerFormat,
    TemplateMismatchError,
    answer_format,
    check_record,
    check_records,
    enforce,
)

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]

PLAIN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Like Qwen3's: the assistant turn renders its reasoning_content inside a thinking wrapper.
REASONING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content %}"
    "<think>\n{{ m.reasoning_content }}\n</think>\n\n"
    "{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A server-side template that differs from the target's: no newline after end-of-turn.
OTHER_TEMPLATE = PLAIN_TEMPLATE.replace("<|im_end|>\n", "<|im_end|>")

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
]
REASONING = "Add two and two."
CONTENT = "It is 4."


def make_tokenizer(
    chat_template: str,
    merges: tuple[tuple[str, str], ...] = (),
    special_tokens: list[str] = SPECIAL_TOKENS,
) -> PreTrainedTokenizerFast:
    """Byte-level vocabulary: any text round-trips; special tokens are single ids. Without
    merges every text has one tokenization; a merge gives a string two possible splits."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet()) + [a + b for a, b in merges]
    backend = Tokenizer(
        models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=list(merges))
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(special_tokens)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer(REASONING_TEMPLATE)


@pytest.fixture(scope="module")
def plain_tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer(PLAIN_TEMPLATE)


def ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def prompt_ids(tokenizer: PreTrainedTokenizerFast, messages: list[dict]) -> list[int]:
    return tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )


def server_record(
    tokenizer: PreTrainedTokenizerFast,
    reasoning: str | None = REASONING,
    content: str = CONTENT,
    messages: list[dict] = MESSAGES,
) -> dict:
    """What the server saves: prompt ids, emitted ids (wrappers, end-of-turn), parsed text."""
    emitted = f"<think>\n{reasoning}\n</think>\n\n{content}" if reasoning else content
    return {
        "id": "p-0000000000000000",
        "messages": messages,
        "content": content,
        "reasoning": reasoning,
        "prompt_token_ids": prompt_ids(tokenizer, messages),
        "completion_token_ids": ids(tokenizer, emitted + "<|im_end|>"),
        "finish_reason": "stop",
    }


def qwen_format(tokenizer: PreTrainedTokenizerFast) -> AnswerFormat:
    """A server with a reasoning parser of <think>/</think> (vLLM's qwen3), stopping at <|im_end|>."""
    return AnswerFormat(
        "qwen3", "<think>", "</think>", frozenset({tokenizer.convert_tokens_to_ids("<|im_end|>")})
    )


def test_correct_record_passes(tokenizer):
    record = server_record(tokenizer)
    result = check_record(tokenizer, record, qwen_format(tokenizer))
    assert result.ok, result.reason
    assert result.part is None and result.first_mismatch is None
    emitted = record["prompt_token_ids"] + record["completion_token_ids"]
    assert result.expected_len == result.rendered_len == len(emitted)


def test_the_format_is_asked_of_vllms_own_parser(tokenizer):
    fmt = answer_format(tokenizer, "qwen3", [7])
    assert (fmt.parser, fmt.opener, fmt.closer) == ("qwen3", "<think>", "</think>")
    assert fmt.stop_ids == {7, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    assert answer_format(tokenizer, None).opener is None


def test_a_reasoning_the_record_lacks_fails_where_it_starts(tokenizer):
    """The ids hold <think>...</think> before the content, the record no reasoning: with the
    run's parser it is a reasoning the record lost, without one text the content lacks."""
    record = server_record(tokenizer) | {"reasoning": None}
    result = check_record(tokenizer, record, qwen_format(tokenizer))
    assert not result.ok and result.part == "completion"
    assert "a reasoning in the ids ('Add two and two.'" in result.reason
    start = len(record["prompt_token_ids"]) + len(ids(tokenizer, "<think>\n"))
    assert result.first_mismatch == start
    result = check_record(tokenizer, record, None)
    assert not result.ok and "text before the content that the content lacks" in result.reason
    assert result.first_mismatch == len(record["prompt_token_ids"])
    assert "'<think>'" in result.reason


def test_reasoning_merged_into_content_fails_where_the_reasoning_starts(tokenizer):
    record = server_record(tokenizer) | {"reasoning": None, "content": f"{REASONING}\n\n{CONTENT}"}
    result = check_record(tokenizer, record, qwen_format(tokenizer))
    assert not result.ok
    assert result.part == "completion" and "that the record lacks" in result.reason
    start = len(record["prompt_token_ids"]) + len(ids(tokenizer, "<think>\n"))
    assert result.first_mismatch == start


def test_a_lost_closer_fails_where_the_reasoning_runs_on_into_the_content(tokenizer):
    record = server_record(tokenizer)
    record["completion_token_ids"] = ids(tokenizer, f"<think>\n{REASONING}\n\n{CONTENT}<|im_end|>")
    result = check_record(tokenizer, record, qwen_format(tokenizer))
    assert not result.ok and "reasoning is not what its ids hold between" in result.reason
    assert result.first_mismatch == len(record["prompt_token_ids"]) + len(
        ids(tokenizer, f"<think>\n{REASONING}\n\n")
    )


def test_another_tokenizer_fails_where_the_text_is_lost(tokenizer):
    """The server tokenized with other merges: the ids decode to other text here."""
    other = make_tokenizer(REASONING_TEMPLATE, merges=(("I", "t"),))
    record = server_record(tokenizer)
    record["completion_token_ids"] = [
        i + 1 if i < 200 else i for i in server_record(other)["completion_token_ids"]
    ]
    result = check_record(tokenizer, record, qwen_format(tokenizer))
    assert not result.ok and result.part == "completion"
    # the shifted ids decode to other text, so the record's reasoning is found nowhere
    assert re.search(r"reasoning is not (in the ids|what its ids hold)", result.reason)


def test_truncated_record_passes(tokenizer):
    full = server_record(tokenizer)
    cut = len(full["completion_token_ids"]) - 4  # mid-content, before <|im_end|>
    completion = full["completion_token_ids"][:cut]
    content = tokenizer.decode(completion).split("</think>\n\n", 1)[1]
    assert 0 < len(content) < len(CONTENT)
    record = full | {"completion_token_ids": completion, "content": content}
    record["finish_reason"] = "length"
    result = check_record(tokenizer, record, qwen_format(tokenizer))
    assert result.ok, result.reason


def test_an_answer_cut_inside_a_multibyte_character_passes(tokenizer):
    """max_tokens can end an answer inside an emoji or a CJK character: its ids decode to a
    replacement character the server's content leaves out. The server says it cut the answer
    (finish_reason length): that is no fault of the template, tokenizer or parser."""
    for text in ("It is 😀", "答案是四"):
        full = server_record(tokenizer, content=text)
        cut = len(full["completion_token_ids"]) - 3  # <|im_end|> and the last 2 bytes
        completion = full["completion_token_ids"][:cut]
        assert tokenizer.decode(completion).endswith("\ufffd")
        content = text[:-1]  # what vLLM's detokenizer gives: the whole characters
        record = full | {
            "completion_token_ids": completion,
            "content": content,
            "finish_reason": "length",
        }
        result = check_record(tokenizer, record, qwen_format(tokenizer))
        assert result.ok, result.reason
        # the same ids said to have stopped: the text lost is a fault
        stopped = check_record(
            tokenizer, record | {"finish_reason": "stop"}, qwen_format(tokenizer)
        )
        assert not stopped.ok


def test_ids_after_the_end_of_turn_fail(tokenizer):
    record = server_record(tokenizer)
    stop = len(record["completion_token_ids"])
    record["completion_token_ids"] += ids(tokenizer, "\n<|im_start|>")
    result = check_record(tokenizer, record, qwen_format(tokenizer))
    assert not result.ok
    assert result.part == "completion" and "end of turn" in result.reason
    assert result.first_mismatch == len(record["prompt_token_ids"]) + stop


def test_text_the_fields_do_not_hold_fails(tokenizer):
    record = server_record(tokenizer)
    record["completion_token_ids"] = ids(
        tokenizer, f"<think>\n{REASONING}\n</think>\n\n{CONTENT} " + "and more " * 10 + "<|im_end|>"
    )
    result = check_record(tokenizer, record, qwen_format(tokenizer))
    assert not result.ok and "content is not what its ids hold outside" in result.reason


def test_wrong_system_prompt_fails_in_prompt(tokenizer):
    record = server_record(tokenizer)
    record["messages"] = [{"role": "system", "content": "You are verbose."}, MESSAGES[1]]
    result = check_record(tokenizer, record)
    assert not result.ok
    assert result.part == "prompt"
    assert result.first_mismatch == len(ids(tokenizer, "<|im_start|>system\nYou are "))


def test_server_with_other_template_fails_in_prompt(tokenizer):
    record = server_record(make_tokenizer(OTHER_TEMPLATE))
    result = check_record(tokenizer, record)
    assert not result.ok
    assert result.part == "prompt"
    system_turn = "<|im_start|>system\nYou are terse.<|im_end|>"
    assert result.first_mismatch == len(ids(tokenizer, system_turn))


def test_the_servers_rendering_is_the_reference_and_the_templates_difference_is_said(tokenizer):
    """vLLM renders some targets otherwise than their chat template (gpt-oss through the
    harmony encoding): the prompt the server rendered is the reference, and the template's
    difference is a fact reported with where it starts, not a failed sample. A prompt other
    than the server's rendering still fails."""
    served = server_record(make_tokenizer(OTHER_TEMPLATE))
    result = check_record(
        tokenizer, served, qwen_format(tokenizer), reference=served["prompt_token_ids"]
    )
    assert result.ok, result.reason
    system_turn = "<|im_start|>system\nYou are terse.<|im_end|>"
    assert result.template_differs.startswith(
        f"prompt token {len(ids(tokenizer, system_turn))} of {len(served['prompt_token_ids'])}"
    )
    # the same rendering as the template's: nothing to say
    plain = server_record(tokenizer)
    assert (
        check_record(
            tokenizer, plain, qwen_format(tokenizer), reference=plain["prompt_token_ids"]
        ).template_differs
        is None
    )
    # ids the server did not render for these messages fail, whoever's template made them
    other = check_record(
        tokenizer, served, qwen_format(tokenizer), reference=plain["prompt_token_ids"]
    )
    assert not other.ok and other.part == "prompt"
    report = check_records(
        tokenizer,
        [served, plain],
        fmt=qwen_format(tokenizer),
        reference=lambda r: r["prompt_token_ids"],
    )
    assert report["mismatched"] == 0 and report["template_differs"] == 1
    assert report["template_first_difference"]["difference"] == result.template_differs


def test_plain_template_without_reasoning_passes(plain_tokenizer):
    result = check_record(plain_tokenizer, server_record(plain_tokenizer, reasoning=None))
    assert result.ok, result.reason


def mixed_records(tokenizer: PreTrainedTokenizerFast) -> list[dict]:
    good = server_record(tokenizer)
    bad = [good | {"id": f"p-bad{i}", "reasoning": None} for i in range(3)]
    return [good | {"id": f"p-good{i}"} for i in range(5)] + bad


def test_check_records_counts_and_rate(tokenizer):
    report = check_records(
        tokenizer, mixed_records(tokenizer), max_listed=2, fmt=qwen_format(tokenizer)
    )
    assert report["checked"] == 8
    assert report["mismatched"] == 3
    assert report["mismatch_rate"] == pytest.approx(3 / 8)
    assert [entry["id"] for entry in report["mismatches"]] == ["p-bad0", "p-bad1"]
    assert {entry["part"] for entry in report["mismatches"]} == {"completion"}


def test_check_records_of_nothing(tokenizer):
    assert check_records(tokenizer, []) == {
        "checked": 0,
        "mismatched": 0,
        "mismatch_rate": 0.0,
        "mismatches": [],
        "retokenized": 0,
        "retokenized_examples": [],
        "template_differs": 0,
        "template_first_difference": None,
        "format": {"reasoning_parser": None, "opener": None, "closer": None},
    }


def test_enforce_raises_above_threshold(tokenizer):
    report = check_records(tokenizer, mixed_records(tokenizer), fmt=qwen_format(tokenizer))
    with pytest.raises(TemplateMismatchError) as raised:
        enforce(report, max_rate=0.2)
    message = str(raised.value)
    assert "p-bad0" in message and "p-bad2" in message
    assert "reasoning_content" in message
    assert "generate.max_template_mismatch_rate" in message


def test_enforce_passes_at_or_below_threshold_and_raises_just_above_it(tokenizer):
    report = check_records(tokenizer, mixed_records(tokenizer), fmt=qwen_format(tokenizer))
    assert report["mismatch_rate"] == pytest.approx(3 / 8)
    assert enforce(report, max_rate=3 / 8) is None  # the threshold itself passes
    assert enforce(report, max_rate=0.5) is None
    with pytest.raises(TemplateMismatchError):
        enforce(report, max_rate=3 / 8 - 1e-9)


def test_non_canonical_split_of_the_same_text_is_retokenized_not_mismatched():
    merged = make_tokenizer(REASONING_TEMPLATE, merges=(("I", "t"),))
    record = server_record(merged)
    canonical = record["completion_token_ids"]
    it = merged.convert_tokens_to_ids("It")
    assert it in canonical  # the tokenizer writes "It" as one token
    at = canonical.index(it)
    # the model emitted "I" and "t" apart: same text, other ids
    split = merged.convert_tokens_to_ids(["I", "t"])
    record["completion_token_ids"] = canonical[:at] + split + canonical[at + 1 :]

    fmt = qwen_format(merged)
    result = check_record(merged, record, fmt)
    assert result.ok and result.retokenized and result.part == "completion"
    report = check_records(merged, [record, server_record(merged)], fmt=fmt)
    assert report["mismatched"] == 0 and report["retokenized"] == 1
    assert report["retokenized_examples"][0]["id"] == record["id"]

    # a lost wrapper is still a mismatch with the same tokenizer
    lost = server_record(merged)
    lost["reasoning"] = None
    assert not check_record(merged, lost, fmt).ok


# A template variable that changes the rendering (as Qwen3's enable_thinking does).
SWITCH_TEMPLATE = (
    "{% if enable_thinking is defined and not enable_thinking %}"
    "<|im_start|>system\n/no_think<|im_end|>\n{% endif %}" + PLAIN_TEMPLATE
)


def test_the_check_renders_with_the_template_variables_the_server_used():
    """generate.chat_template_kwargs: the server rendered the prompt with enable_thinking
    false; the record keeps the variables and the check renders with them (without them the
    same record is a prompt mismatch)."""
    switch = make_tokenizer(SWITCH_TEMPLATE)
    prompt = ids(
        switch,
        "<|im_start|>system\n/no_think<|im_end|>\n<|im_start|>system\nYou are "
        "terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n",
    )
    record = {
        **server_record(switch, reasoning=None),
        "prompt_token_ids": prompt,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert check_record(switch, record).ok
    del record["chat_template_kwargs"]
    result = check_record(switch, record)
    assert not result.ok and result.part == "prompt"


# -- a template shaped like Kimi-K2.5's ----------------------------------------------------

KIMI_SPECIAL_TOKENS = [
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|im_end|>",
    "<think>",
    "</think>",
]


def kimi_like_template(history_through: str) -> str:
    """A template shaped like Kimi-K2.5's (written for these tests): a default system turn
    when none is given; the generation prompt opens the reasoning with ``<think>`` (renders an
    empty ``<think></think>`` when the variable ``thinking`` is false); assistant turns of the
    history render an empty ``<think></think>``, later ones ``<think>`` reasoning ``</think>``,
    then the content. The history runs through the last message of role ``history_through``
    without tool calls: ``"assistant"`` as in K2.5's own template (so a conversation that ends
    in the answer renders the answer itself as history), ``"user"`` as the template is often
    described (assistant turns before the last user message)."""
    return (
        "{%- set ns = namespace(history_end=-1) -%}"
        "{%- for m in messages -%}"
        f"{{%- if m.role == '{history_through}' and not m.tool_calls -%}}"
        "{%- set ns.history_end = loop.index0 -%}{%- endif -%}"
        "{%- endfor -%}"
        "{%- set thinking_off = thinking is defined and thinking is false -%}"
        "{%- if messages[0].role != 'system' -%}"
        "<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>"
        "{%- endif -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
        "{%- if loop.index0 <= ns.history_end or thinking_off -%}<think></think>"
        "{%- else -%}<think>{{ m.reasoning_content or '' }}</think>{%- endif -%}"
        "{%- elif m.role == 'user' -%}<|im_user|>user<|im_middle|>"
        "{%- else -%}<|im_system|>{{ m.role }}<|im_middle|>{%- endif -%}"
        "{{ m.content }}<|im_end|>"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
        "{%- if thinking_off -%}<think></think>{%- else -%}<think>{%- endif -%}"
        "{%- endif -%}"
    )


KIMI_K25_TEMPLATE = kimi_like_template("assistant")
LAST_USER_TEMPLATE = kimi_like_template("user")
KIMI_MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
FOLLOWUPS = ["And 3+3?", "And 4+4?"]


def make_kimi_tokenizer(template: str = KIMI_K25_TEMPLATE) -> PreTrainedTokenizerFast:
    return make_tokenizer(template, special_tokens=KIMI_SPECIAL_TOKENS)


@pytest.fixture(scope="module")
def kimi() -> PreTrainedTokenizerFast:
    return make_kimi_tokenizer()


def kimi_format(tokenizer: PreTrainedTokenizerFast) -> AnswerFormat:
    """The format of a server with --reasoning-parser kimi_k2, its markers asked of vLLM."""
    return answer_format(tokenizer, "kimi_k2", [tokenizer.convert_tokens_to_ids("<|im_end|>")])


@pytest.fixture(
    scope="module",
    params=["history through the last answer", "history before the last user message"],
)
def kimi_shapes(request) -> PreTrainedTokenizerFast:
    return make_kimi_tokenizer(
        KIMI_K25_TEMPLATE if "answer" in request.param else LAST_USER_TEMPLATE
    )


def kimi_k2_parse(text: str, thinking: bool) -> tuple[str | None, str | None]:
    """(reasoning, content) as vLLM 0.32's ``kimi_k2`` reasoning parser makes them of an
    answer's text (test_the_parser_stand_in_splits_as_vllms_kimi_k2_parser holds it to the
    real one): with thinking on it starts in the reasoning, drops ``<think>``, ends the
    reasoning at the first ``</think>`` (dropping later ones) and strips whitespace from the
    reasoning's end; with thinking off everything is content."""
    if not thinking:
        return None, text or None
    reasoning, _, content = text.partition("</think>")
    reasoning = reasoning.replace("<think>", "").rstrip()
    return reasoning or None, content.replace("</think>", "") or None


def kimi_record(
    tokenizer: PreTrainedTokenizerFast,
    messages: list[dict],
    emitted: str,
    thinking: bool = True,
    finish: str = "stop",
) -> dict:
    """The record eaglet saves of a chat completion from a server with ``--reasoning-parser
    kimi_k2``: ``emitted`` is what the model wrote after the generation prompt (ending in
    ``<|im_end|>`` when it stopped). vLLM parses the text of the ids with special tokens
    (the parser turns skip_special_tokens off) but without the end-of-turn it stopped at."""
    kwargs = None if thinking else {"thinking": False}
    completion = ids(tokenizer, emitted)
    text = tokenizer.decode(
        completion[:-1] if finish == "stop" else completion, skip_special_tokens=False
    )
    reasoning, content = kimi_k2_parse(text, thinking)
    record = {
        "id": "p-0000000000000000",
        "messages": messages,
        "content": content,
        "reasoning": reasoning,
        "prompt_token_ids": tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False, **(kwargs or {})
        ),
        "completion_token_ids": completion,
        "finish_reason": finish,
    }
    if kwargs:
        record["chat_template_kwargs"] = kwargs
    return record


def kimi_conversation(
    tokenizer: PreTrainedTokenizerFast, answer: str, thinking: bool, finish: str, turns: int
) -> list[dict]:
    """The records of a conversation of ``turns`` turns (generate.max_turns), each turn's
    messages built as generation builds them (generate.next_turn) from the earlier answers;
    ``answer`` is a format string of what the model emits, {n} the turn."""
    from eaglet.stages.generate.answers import next_turn

    records, messages = [], KIMI_MESSAGES
    for turn in range(turns):
        if turn:
            messages = next_turn(messages, records[-1], FOLLOWUPS[turn - 1])
        records.append(
            kimi_record(tokenizer, messages, answer.format(n=turn + 2), thinking, finish)
        )
    return records


# what the model emits after the generation prompt, with thinking on and off
KIMI_ANSWERS = {
    "reasoning then content": ("Add {n} and {n}.</think>It is {n}.<|im_end|>", True, "stop"),
    "a newline the parser strips": (
        "Add {n} and {n}.\n</think>\n\nIt is {n}.<|im_end|>",
        True,
        "stop",
    ),
    "no reasoning": ("</think>It is {n}.<|im_end|>", True, "stop"),
    "cut at max_tokens in the reasoning": ("Add {n} and", True, "length"),
    "cut at max_tokens after a newline": ("Add {n} and {n}.\n\n", True, "length"),
    "cut at max_tokens in the content": ("Add {n}.</think>It i", True, "length"),
    "thinking off": ("It is {n}.<|im_end|>", False, "stop"),
    "thinking off, cut at max_tokens": ("It is", False, "length"),
}


def test_a_conversation_ending_in_the_answer_renders_it_as_history_with_an_empty_reasoning(kimi):
    """Where the plain round trip breaks on K2.5's template: the conversation with the answer
    renders the answer as history, ``</think>`` where the model's reasoning begins."""
    from eaglet.data.template_check import assistant_message, first_difference, render_ids

    record = kimi_record(kimi, KIMI_MESSAGES, "Add 2 and 2.</think>It is 2.<|im_end|>")
    assert record["reasoning"] == "Add 2 and 2." and record["content"] == "It is 2."
    plain = render_ids(
        kimi, [*record["messages"], assistant_message(record)], add_generation_prompt=False
    )
    prompt = record["prompt_token_ids"]
    assert prompt[-1] == kimi.convert_tokens_to_ids("<think>")  # the prompt opens the reasoning
    assert first_difference(prompt + record["completion_token_ids"], plain) == len(prompt)
    assert plain[len(prompt)] == kimi.convert_tokens_to_ids("</think>")


@pytest.mark.parametrize("turns", [1, 3], ids=["one turn", "three turns"])
@pytest.mark.parametrize("answer", list(KIMI_ANSWERS))
def test_kimi_like_records_round_trip(kimi_shapes, answer, turns):
    """Records as vLLM's kimi_k2 parser shapes them pass, single- and multi-turn, thinking on
    and off, stopped or cut at max_tokens, for both readings of the template's history."""
    records = kimi_conversation(kimi_shapes, *KIMI_ANSWERS[answer], turns)
    for turn, record in enumerate(records):
        result = check_record(kimi_shapes, record, kimi_format(kimi_shapes))
        assert result.ok and not result.retokenized, f"turn {turn + 1}: {result.reason}"
    report = check_records(kimi_shapes, records, fmt=kimi_format(kimi_shapes))
    assert report["mismatched"] == 0 and report["retokenized"] == 0


def test_later_turns_carry_the_earlier_answers_content_as_the_server_rendered_it(kimi):
    """The next turn's messages hold the earlier answer as a plain assistant turn: the
    template renders it as history (empty reasoning) both on the server and in the check."""
    first, second = kimi_conversation(kimi, *KIMI_ANSWERS["reasoning then content"], turns=2)
    assert second["messages"][1] == {"role": "assistant", "content": "It is 2."}
    prompt = kimi.decode(second["prompt_token_ids"], skip_special_tokens=False)
    assert (
        "<|im_assistant|>assistant<|im_middle|><think></think>It is 2.<|im_end|>"
        "<|im_user|>user<|im_middle|>And 3+3?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    ) in prompt
    assert check_record(kimi, second, kimi_format(kimi)).ok


def kimi_mismatches(kimi: PreTrainedTokenizerFast) -> dict[str, tuple[dict, int]]:
    """Records whose text does not describe their ids, and where each must fail."""
    good = kimi_record(kimi, KIMI_MESSAGES, "Add 2 and 2.</think>It is 2.<|im_end|>")
    start = len(good["prompt_token_ids"])
    closer = start + len(ids(kimi, "Add 2 and 2."))  # where the model emitted </think>
    return {
        # the ids lack the closer the text fields imply
        "lost closer": (
            {**good, "completion_token_ids": ids(kimi, "Add 2 and 2.It is 2.<|im_end|>")},
            closer,
        ),
        # a server without the reasoning parser: special tokens skipped, all text content
        # (the ids hold a reasoning there, which the record lacks)
        "no reasoning parser": (
            {**good, "reasoning": None, "content": "Add 2 and 2.It is 2."},
            start,
        ),
        # reasoning and content merged into the reasoning
        "merged into the reasoning": (
            {**good, "reasoning": "Add 2 and 2.It is 2.", "content": None},
            closer,
        ),
        # a thinking-off answer saved as reasoning
        "content saved as reasoning": (
            {
                **kimi_record(kimi, KIMI_MESSAGES, "It is 2.<|im_end|>", thinking=False),
                "reasoning": "It is 2.",
                "content": None,
            },
            len(kimi_record(kimi, KIMI_MESSAGES, "", thinking=False)["prompt_token_ids"]),
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "lost closer",
        "no reasoning parser",
        "merged into the reasoning",
        "content saved as reasoning",
    ],
)
def test_kimi_like_real_mismatches_are_still_caught(kimi, case):
    record, index = kimi_mismatches(kimi)[case]
    result = check_record(kimi, record, kimi_format(kimi))
    assert not result.ok and not result.retokenized
    assert result.part == "completion" and result.first_mismatch == index, result.reason


def test_answer_opening_is_what_the_template_writes_between_prompt_and_content(
    kimi, tokenizer, plain_tokenizer
):
    from eaglet.data.template_check import answer_opening

    assert answer_opening(kimi, KIMI_MESSAGES) == "</think>"
    assert answer_opening(kimi, KIMI_MESSAGES, {"thinking": False}) == ""
    # K2.5's shape drops the answer's reasoning; the other shape renders it
    assert answer_opening(kimi, KIMI_MESSAGES, reasoning="r") == "</think>"
    assert (
        answer_opening(make_kimi_tokenizer(LAST_USER_TEMPLATE), KIMI_MESSAGES, reasoning="r")
        == "r</think>"
    )
    assert answer_opening(plain_tokenizer, MESSAGES) == ""
    assert answer_opening(tokenizer, MESSAGES, reasoning="r") == "<think>\nr\n</think>\n\n"


def test_the_parser_stand_in_splits_as_vllms_kimi_k2_parser(kimi):
    """kimi_k2_parse against vLLM's own parser, on the answers these tests use."""
    from types import SimpleNamespace

    parser_module = pytest.importorskip("vllm.reasoning.kimi_k2_reasoning_parser")
    request = SimpleNamespace(include_reasoning=True, tools=None, tool_choice=None)
    texts = [
        answer.format(n=2).removesuffix("<|im_end|>") for answer, _, _ in KIMI_ANSWERS.values()
    ] + ["<think>Add.</think>It</think> is."]
    for thinking in (True, False):
        kwargs = {} if thinking else {"thinking": False}
        for text in texts:
            parser = parser_module.KimiK2ReasoningParser(kimi, chat_template_kwargs=kwargs)
            assert parser.extract_reasoning(text, request) == kimi_k2_parse(text, thinking), text
