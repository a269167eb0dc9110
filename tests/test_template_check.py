"""Template round-trip check on a tiny byte-level tokenizer with ChatML templates."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from eaglet.template_check import (
    TemplateMismatchError,
    check_record,
    check_records,
    enforce,
    render_conversation_ids,
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


def make_tokenizer(chat_template: str, merges: tuple[tuple[str, str], ...] = ()) -> PreTrainedTokenizerFast:
    """Byte-level vocabulary: any text round-trips; special tokens are single ids. Without
    merges every text has one tokenization; a merge gives a string two possible splits."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet()) + [a + b for a, b in merges]
    backend = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)},
                                   merges=list(merges)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
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


def test_render_conversation_ids_is_a_list_of_ints(tokenizer):
    rendered = render_conversation_ids(tokenizer, server_record(tokenizer))
    expected = ids(
        tokenizer,
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        f"<|im_start|>assistant\n<think>\n{REASONING}\n</think>\n\n{CONTENT}<|im_end|>\n",
    )
    assert rendered == expected
    assert all(type(token) is int for token in rendered)


def test_correct_record_passes(tokenizer):
    record = server_record(tokenizer)
    result = check_record(tokenizer, record)
    assert result.ok, result.reason
    assert result.part is None and result.first_mismatch is None
    emitted = record["prompt_token_ids"] + record["completion_token_ids"]
    assert result.expected_len == len(emitted)
    assert result.rendered_len == result.expected_len + 1  # the template's newline after <|im_end|>


def test_lost_thinking_wrapper_fails_at_think(tokenizer):
    record = server_record(tokenizer) | {"reasoning": None}
    result = check_record(tokenizer, record)
    assert not result.ok
    assert result.part == "completion"
    assert result.first_mismatch == len(record["prompt_token_ids"])
    assert "'<think>'" in result.reason


def test_reasoning_merged_into_content_without_tags_fails(tokenizer):
    record = server_record(tokenizer) | {"reasoning": None, "content": f"{REASONING}\n\n{CONTENT}"}
    result = check_record(tokenizer, record)
    assert not result.ok
    assert result.part == "completion"
    assert result.first_mismatch == len(record["prompt_token_ids"])


def test_truncated_record_passes(tokenizer):
    full = server_record(tokenizer)
    cut = len(full["completion_token_ids"]) - 4  # mid-content, before <|im_end|>
    completion = full["completion_token_ids"][:cut]
    content = tokenizer.decode(completion).split("</think>\n\n", 1)[1]
    assert 0 < len(content) < len(CONTENT)
    record = full | {"completion_token_ids": completion, "content": content}
    record["finish_reason"] = "length"
    result = check_record(tokenizer, record)
    assert result.ok, result.reason


def test_rendering_that_stops_early_fails(tokenizer):
    record = server_record(tokenizer)
    record["completion_token_ids"] += ids(tokenizer, "\n<|im_start|>")
    result = check_record(tokenizer, record)
    assert not result.ok
    assert result.part == "completion"
    assert result.first_mismatch == result.rendered_len
    assert "[end]" in result.reason


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


def test_plain_template_without_reasoning_passes(plain_tokenizer):
    result = check_record(plain_tokenizer, server_record(plain_tokenizer, reasoning=None))
    assert result.ok, result.reason


def mixed_records(tokenizer: PreTrainedTokenizerFast) -> list[dict]:
    good = server_record(tokenizer)
    bad = [good | {"id": f"p-bad{i}", "reasoning": None} for i in range(3)]
    return [good | {"id": f"p-good{i}"} for i in range(5)] + bad


def test_check_records_counts_and_rate(tokenizer):
    report = check_records(tokenizer, mixed_records(tokenizer), max_listed=2)
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
    }


def test_enforce_raises_above_threshold(tokenizer):
    report = check_records(tokenizer, mixed_records(tokenizer))
    with pytest.raises(TemplateMismatchError) as raised:
        enforce(report, max_rate=0.2)
    message = str(raised.value)
    assert "p-bad0" in message and "p-bad2" in message
    assert "reasoning_content" in message
    assert "generate.max_template_mismatch_rate" in message


def test_enforce_passes_at_or_below_threshold_and_raises_just_above_it(tokenizer):
    report = check_records(tokenizer, mixed_records(tokenizer))
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
    record["completion_token_ids"] = canonical[:at] + split + canonical[at + 1:]

    result = check_record(merged, record)
    assert result.ok and result.retokenized and result.part == "completion"
    report = check_records(merged, [record, server_record(merged)])
    assert report["mismatched"] == 0 and report["retokenized"] == 1
    assert report["retokenized_examples"][0]["id"] == record["id"]

    # a lost wrapper is still a mismatch with the same tokenizer
    lost = server_record(merged)
    lost["reasoning"] = None
    assert not check_record(merged, lost).ok


# A template variable that changes the rendering (as Qwen3's enable_thinking does).
SWITCH_TEMPLATE = ("{% if enable_thinking is defined and not enable_thinking %}"
                   "<|im_start|>system\n/no_think<|im_end|>\n{% endif %}" + PLAIN_TEMPLATE)


def test_the_check_renders_with_the_template_variables_the_server_used():
    """generate.chat_template_kwargs: the server rendered the prompt with enable_thinking
    false; the record keeps the variables and the check renders with them (without them the
    same record is a prompt mismatch)."""
    switch = make_tokenizer(SWITCH_TEMPLATE)
    prompt = ids(switch, "<|im_start|>system\n/no_think<|im_end|>\n<|im_start|>system\nYou are "
                         "terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                         "<|im_start|>assistant\n")
    record = {**server_record(switch, reasoning=None), "prompt_token_ids": prompt,
              "chat_template_kwargs": {"enable_thinking": False}}
    assert check_record(switch, record).ok
    del record["chat_template_kwargs"]
    result = check_record(switch, record)
    assert not result.ok and result.part == "prompt"
