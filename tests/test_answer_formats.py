"""The sample check and the miniature's teaching on four reasoning formats, from the stand-in
files of four targets (tests/standins): Kimi-K2.5 (the generation prompt opens the reasoning,
history renders an empty <think></think>), Qwen3 (the answer opens it, history keeps the last
turns' reasoning), DeepSeek-R1-Distill-Qwen (the prompt opens it, history drops it) and Gemma 4
(a thought channel, <|channel>...<channel|>, history drops it). The text fields of every
answer are what vLLM's own reasoning parser makes of its ids; no family is modelled by name in
eaglet, and each kind of real mismatch still fails."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from eaglet.data.template_check import answer_format, check_record, render_ids, text_ids
from eaglet.tools.miniature import answer_text
from tests.helpers.paths import STANDINS

# stand-in: (reasoning parser, template variables, trust_remote_code)
FAMILIES = {
    "kimi-k2.5": ("kimi_k2", {"thinking": True}, True),
    "qwen3-8b": ("qwen3", {"enable_thinking": True}, False),
    "deepseek-r1-distill-qwen-7b": ("deepseek_r1", {}, False),
    "gemma-4-e2b-it": ("gemma4", {"enable_thinking": True}, False),
}
MESSAGES = [{"role": "user", "content": "What is two and two? Say it briefly."}]
REASONING, CONTENT = "The user asks a sum. Two and two make four.", "It is four."


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> SimpleNamespace:
    name = request.param
    parser, kwargs, trust = FAMILIES[name]
    tokenizer = AutoTokenizer.from_pretrained(STANDINS / name, trust_remote_code=trust)
    eos = json.loads((STANDINS / name / "generation_config.json").read_text())["eos_token_id"]
    fmt = answer_format(tokenizer, parser, eos if isinstance(eos, list) else [eos], kwargs)
    return SimpleNamespace(name=name, parser=parser, kwargs=kwargs, tokenizer=tokenizer, fmt=fmt)


def served(
    family,
    completion: list[int],
    messages=MESSAGES,
    prompt: list[int] | None = None,
    finish: str = "stop",
) -> dict:
    """The record generation saves of an answer whose ids are ``completion``: the text fields
    as vLLM's reasoning parser makes them of the text of the ids (special tokens kept, the
    end of turn the server stopped at left out)."""
    from vllm.reasoning import ReasoningParserManager

    tok = family.tokenizer
    body = (
        completion[:-1]
        if finish == "stop" and completion[-1] in family.fmt.stop_ids
        else completion
    )
    parser = ReasoningParserManager.get_reasoning_parser(family.parser)(
        tok, chat_template_kwargs=family.kwargs
    )
    request = SimpleNamespace(
        include_reasoning=True, tools=None, tool_choice=None, chat_template_kwargs=family.kwargs
    )
    reasoning, content = parser.extract_reasoning(
        tok.decode(body, skip_special_tokens=False), request
    )
    record = {
        "id": "p-0",
        "messages": messages,
        "reasoning": reasoning,
        "content": content,
        "prompt_token_ids": prompt or render_ids(tok, messages, True, family.kwargs),
        "completion_token_ids": completion,
        "finish_reason": finish,
    }
    if family.kwargs:
        record["chat_template_kwargs"] = family.kwargs
    return record


def answer_ids(family, reasoning: str | None = REASONING, content: str = CONTENT) -> list[int]:
    text, _ = answer_text(family.tokenizer, MESSAGES, family.kwargs, family.fmt, reasoning, content)
    return text_ids(family.tokenizer, text)


def test_the_parsers_markers_come_from_vllm(family):
    assert family.fmt.opener and family.fmt.closer
    vocab = family.tokenizer.get_vocab()
    assert family.fmt.opener in vocab and family.fmt.closer in vocab


def test_an_answer_as_the_model_writes_it_passes_and_splits(family):
    record = served(family, answer_ids(family))
    assert record["reasoning"].strip() == REASONING and record["content"].strip() == CONTENT
    result = check_record(family.tokenizer, record, family.fmt)
    assert result.ok and not result.retokenized, result.reason


@pytest.mark.parametrize("cut", [5, 12])
def test_an_answer_cut_at_max_tokens_passes(family, cut):
    record = served(family, answer_ids(family)[:cut], finish="length")
    result = check_record(family.tokenizer, record, family.fmt)
    assert result.ok, result.reason


def test_a_later_turn_renders_the_earlier_answer_as_history_and_passes(family):
    from eaglet.stages.generate.answers import next_turn

    first = served(family, answer_ids(family))
    messages = next_turn(MESSAGES, first, "And three and three?")
    text, _ = answer_text(family.tokenizer, messages, family.kwargs, family.fmt, REASONING, "Six.")
    record = served(family, text_ids(family.tokenizer, text), messages=messages)
    result = check_record(family.tokenizer, record, family.fmt)
    assert result.ok, result.reason


def test_a_server_on_another_template_fails_in_the_prompt(family):
    other = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    prompt = family.tokenizer.apply_chat_template(
        MESSAGES, chat_template=other, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    record = served(family, answer_ids(family), prompt=list(prompt))
    result = check_record(family.tokenizer, record, family.fmt)
    assert not result.ok and result.part == "prompt"


def test_a_lost_wrapper_token_fails_in_the_completion(family):
    completion = answer_ids(family)
    closer = family.tokenizer.convert_tokens_to_ids(family.fmt.closer)
    record = served(family, completion)  # the fields of the answer the model wrote
    record["completion_token_ids"] = [t for t in completion if t != closer]
    result = check_record(family.tokenizer, record, family.fmt)
    assert not result.ok and result.part == "completion", result.reason


def test_ids_of_another_tokenizer_fail_in_the_completion(family):
    other = "qwen3-8b" if family.name != "qwen3-8b" else "gemma-4-e2b-it"
    other_tokenizer = AutoTokenizer.from_pretrained(STANDINS / other)
    record = served(family, answer_ids(family))
    text = family.tokenizer.decode(record["completion_token_ids"], skip_special_tokens=False)
    record["completion_token_ids"] = text_ids(other_tokenizer, text)
    result = check_record(family.tokenizer, record, family.fmt)
    assert not result.ok and result.part == "completion", result.reason


def test_content_saved_as_reasoning_fails(family):
    record = served(family, answer_ids(family, reasoning=None))
    assert not (record["reasoning"] or "").strip() and record["content"].strip() == CONTENT
    assert check_record(family.tokenizer, record, family.fmt).ok
    record = {**record, "reasoning": record["content"], "content": None}
    result = check_record(family.tokenizer, record, family.fmt)
    assert not result.ok and result.part == "completion", result.reason
