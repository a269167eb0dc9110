"""A harmony-format target (gpt-oss), whose prompts vLLM renders with the harmony encoding
rather than its chat template and whose answers it parses from the token ids: the stand-in's
tokenizer is the real o200k_harmony encoding, the sample check takes the server's rendering as
the reference (the template's difference is reported, not failed), a lost marker and another
tokenizer still fail, and the miniature is taught the analysis and final channels from the
field the template reads the reasoning from (``thinking``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eaglet.data.template_check import answer_format, check_record, text_ids
from eaglet.tools.miniature import answer_text, closer_text
from tests.helpers.paths import STANDINS

# the stand-in's tokenizer every test reads is built by a script run in a subprocess
pytestmark = pytest.mark.subprocess

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant. Answer clearly."},
    {"role": "user", "content": "What is two and two? Say it briefly."},
]
REASONING, CONTENT = "The user asks a sum. Two and two make four.", "It is four."
SEPARATOR = "<|end|><|start|>assistant<|channel|>final<|message|>"


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """The stand-in's files with the tokenizer built from the installed encoding."""
    directory = tmp_path_factory.mktemp("gpt-oss") / "gpt-oss-20b"
    shutil.copytree(STANDINS / "gpt-oss-20b", directory)
    subprocess.run(
        [sys.executable, str(STANDINS / "make_harmony_tokenizer.py"), str(directory)],
        check=True,
        capture_output=True,
    )
    return directory


@pytest.fixture(scope="module")
def tokenizer(target):
    return AutoTokenizer.from_pretrained(target)


@pytest.fixture(scope="module")
def fmt(tokenizer, target):
    eos = json.loads((target / "generation_config.json").read_text())["eos_token_id"]
    return answer_format(tokenizer, "openai_gptoss", eos)


def harmony():
    from vllm.entrypoints.openai.parser import harmony_utils

    return harmony_utils


def server_prompt(messages: list[dict]) -> list[int]:
    """The prompt ids vLLM's chat endpoint renders for a gpt-oss target: the harmony preamble
    (system message, the conversation's system prompt as the developer's instructions), then
    the messages, through vLLM's own functions."""
    h = harmony()
    instructions, rest = h.extract_instructions_from_messages(messages)
    return h.render_for_completion(
        h.build_harmony_preamble(instructions=instructions)
        + h.parse_chat_inputs_to_harmony_messages(rest)
    )


def served(tokenizer, completion: list[int], messages=MESSAGES) -> dict:
    """The record generation saves: the server's prompt ids, the emitted ids, and the text
    fields as the harmony encoding parses the ids (the analysis channel's text is the
    reasoning, the final channel's the content)."""
    from openai_harmony import Role

    parsed = (
        harmony().get_encoding().parse_messages_from_completion_tokens(completion, Role.ASSISTANT)
    )
    by_channel = {m.channel: "".join(c.text for c in m.content) for m in parsed}
    return {
        "id": "p-0",
        "messages": messages,
        "reasoning": by_channel.get("analysis"),
        "content": by_channel.get("final"),
        "prompt_token_ids": server_prompt(messages),
        "completion_token_ids": completion,
        "finish_reason": "stop",
    }


def answer(tokenizer, reasoning=REASONING, content=CONTENT) -> list[int]:
    return text_ids(
        tokenizer, f"<|channel|>analysis<|message|>{reasoning}{SEPARATOR}{content}<|return|>"
    )


def test_the_standins_tokenizer_is_the_harmony_encoding(tokenizer):
    encoding = harmony().get_encoding()
    for text in (
        "Hello world! How's it going?",
        "def f(x):\n    return x**2  # 你好 😀",
        "  spaces\n\n\nnewlines 12345 67 don't",
        "Ünïcödé — ‘quotes’ … ½",
    ):
        assert tokenizer.encode(text, add_special_tokens=False) == encoding.encode(
            text, allowed_special=set()
        ), text
    for name in ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>"):
        assert (
            tokenizer.convert_tokens_to_ids(name)
            == encoding.encode(name, allowed_special={name})[0]
        )


def test_a_harmony_answer_checks_against_the_servers_rendering(tokenizer, fmt):
    """The parser names no markers (vLLM parses harmony from the ids): the reasoning and the
    content are found in order, with the channels' few wrapper tokens around them. The prompt
    is the server's; the template renders the developer message with a blank line more, which
    is said, not failed."""
    assert (fmt.opener, fmt.closer) == (None, None)
    record = served(tokenizer, answer(tokenizer))
    assert (record["reasoning"], record["content"]) == (REASONING, CONTENT)
    result = check_record(tokenizer, record, fmt, reference=record["prompt_token_ids"])
    assert result.ok, result.reason
    assert result.template_differs and "Answer clearly" in result.template_differs
    # the template as the reference would have failed every sample with a system prompt
    assert not check_record(tokenizer, record, fmt).ok


def test_a_lost_marker_and_another_tokenizer_still_fail(tokenizer, fmt):
    record = served(tokenizer, answer(tokenizer))
    reference = record["prompt_token_ids"]
    lost = dict(
        record,
        completion_token_ids=text_ids(
            tokenizer, f"<|channel|>analysis<|message|>{REASONING}{CONTENT}<|return|>"
        ),
    )
    result = check_record(tokenizer, lost, fmt, reference=reference)
    assert not result.ok and result.part == "completion", result.reason
    other = AutoTokenizer.from_pretrained(STANDINS / "qwen3-8b")
    foreign = dict(
        record,
        completion_token_ids=other.encode(f"{REASONING} {CONTENT}", add_special_tokens=False)
        + [200002],
    )
    result = check_record(tokenizer, foreign, fmt, reference=reference)
    assert not result.ok and result.part == "completion", result.reason
    # a prompt the server did not render for these messages fails too
    moved = dict(record, prompt_token_ids=server_prompt(MESSAGES[1:]))
    assert check_record(tokenizer, moved, fmt, reference=reference).part == "prompt"


def test_the_miniature_is_taught_the_channels_from_the_field_the_template_reads(tokenizer, fmt):
    """gpt-oss's template reads an answer's reasoning from ``thinking``: offered under every
    name templates use, the template renders it, and its rendering is the taught format: the
    analysis channel, the final one, the end of the answer. What closes the reasoning is what
    the template writes between the two channels."""
    text, how = answer_text(tokenizer, MESSAGES, {}, fmt, REASONING, CONTENT)
    assert how == "the template's rendering of the answer"
    assert text == f"<|channel|>analysis<|message|>{REASONING}{SEPARATOR}{CONTENT}<|return|>"
    assert closer_text(tokenizer, MESSAGES, {}, fmt) == SEPARATOR
    # what the taught answer is, the check takes
    record = served(tokenizer, text_ids(tokenizer, text))
    assert check_record(tokenizer, record, fmt, reference=record["prompt_token_ids"]).ok
