"""A target in Mistral's own format (params.json, tekken.json, consolidated weights; no chat
template), rendered and served the way vLLM serves it: mistral_common renders its prompts, a
special token's text is never read as the token, an answer-last conversation is rendered as
an answer in progress, and the miniature is written in the format vLLM's Mistral loader reads.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.paths import STANDINS

MAGISTRAL = STANDINS / "magistral-small-2507"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """The Magistral stand-in with its Tekken file built from mistral_common's data."""
    folder = tmp_path_factory.mktemp("files") / MAGISTRAL.name
    shutil.copytree(MAGISTRAL, folder)
    spec = importlib.util.spec_from_file_location("tekken", STANDINS / "make_tekken_tokenizer.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    builder.build(folder)
    return folder


def load_tokenizer(folder):
    from eaglet.stages.generate.rendering import load_tokenizer

    return load_tokenizer(folder, trust_remote_code=False)


@pytest.fixture(scope="module")
def tekken(files):
    return load_tokenizer(files)


def test_a_tekken_only_target_gets_mistral_commons_tokenizer_as_vllm_does(files, tmp_path):
    from eaglet.engine.support import mistral_mode
    from eaglet.stages.generate.rendering import load_tokenizer

    # config files alone: Mistral's format, whose weights decide the mode when they come
    assert mistral_mode(files) is None
    # without config.json transformers would build a plain tokenizer with no chat format
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy2(files / "tekken.json", bare / "tekken.json")
    (bare / "params.json").write_text((files / "params.json").read_text())
    for folder in (files, bare):
        tokenizer = load_tokenizer(folder, trust_remote_code=False)
        assert type(tokenizer).__name__ == "MistralCommonBackend"
        assert tokenizer.convert_tokens_to_ids(["</s>", "[THINK]", "[/THINK]"]) == [2, 34, 35]


def test_special_token_text_becomes_the_token_where_tekken_reads_it_as_plain_text(tekken):
    from eaglet.data.template_check import text_ids

    # Tekken reads "[THINK]" as four plain tokens; its renderer puts the token in by id
    assert 34 not in tekken("[THINK]", add_special_tokens=False)["input_ids"]
    ids = text_ids(tekken, "[THINK]I think.[/THINK]Yes.</s>")
    assert ids[0] == 34 and 35 in ids and ids[-1] == 2
    assert tekken.decode(ids, skip_special_tokens=False) == "[THINK]I think.[/THINK]Yes.</s>"


def test_text_ids_of_a_tokenizer_that_reads_special_text_are_its_own():
    from transformers import AutoTokenizer

    from eaglet.data.template_check import text_ids

    qwen = AutoTokenizer.from_pretrained(STANDINS / "qwen3-8b")
    text = "<think>\nwhy\n</think>\n\nso.<|im_end|>"
    assert text_ids(qwen, text) == qwen(text, add_special_tokens=False)["input_ids"]


def test_an_answer_last_conversation_renders_as_an_answer_in_progress(tekken):
    """mistral_common refuses a conversation that ends with an assistant turn unless it is
    continued (vLLM's continue_final_message): the answer then has no end of turn."""
    from eaglet.data.template_check import render_answered, render_ids

    messages = [{"role": "user", "content": "Hello"}]
    prompt = render_ids(tekken, messages, True)
    whole, ended = render_answered(tekken, [*messages, {"role": "assistant", "content": "Hi."}])
    assert not ended
    assert whole[: len(prompt)] == prompt and whole[len(prompt) :] == tekken.encode(
        "Hi.", add_special_tokens=False
    )


def test_a_recorded_answer_ends_with_the_targets_stop_id_in_mistrals_format(tekken, files):
    from eaglet.stages.generate.rendering import dataset_record

    prompt = {"id": "p", "messages": [{"role": "user", "content": "Hello"}], "answer": "Hi."}
    gen = {"chat_template_kwargs": None, "system_prompt": None, "max_tokens": 64}
    record = dataset_record(prompt, tekken, gen, {2})
    assert record["completion_token_ids"][-1] == 2 and record["finish_reason"] == "stop"
    assert record["content"] == "Hi."


def test_the_mistral_parser_names_the_think_tokens_of_the_stand_in(tekken):
    from eaglet.data.template_check import answer_format

    fmt = answer_format(tekken, "mistral", [2])
    assert (fmt.opener, fmt.closer) == ("[THINK]", "[/THINK]")


def test_the_miniature_in_mistrals_format_loads_back_through_vllms_mistral_loader(tmp_path):
    """Every tensor written under Mistral's name comes back, through vLLM's own remapping
    (names and the rotary permutation of wq and wk), as the transformers tensor it was."""
    import torch
    from safetensors.torch import load_file
    from transformers import MistralConfig, MistralForCausalLM
    from vllm.model_executor.models.mistral import MistralForCausalLM as Served

    from eaglet.tools import mistral_format

    small = MistralConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
    )
    torch.manual_seed(0)
    model = MistralForCausalLM(small)
    source = tmp_path / "source"
    source.mkdir()
    (source / "params.json").write_text(
        json.dumps({"dim": 5120, "n_layers": 40, "vocab_size": 131072, "vision_encoder": {}})
    )
    written = mistral_format.write(model, small.to_dict(), source, tmp_path)
    params = json.loads((tmp_path / "params.json").read_text())
    assert (params["dim"], params["n_layers"], params["head_dim"]) == (64, 2, 16)
    assert "vision_encoder" not in params and params["dtype"] == "float32"
    loader = type("Loader", (), {"mistral_mapping": Served.mistral_mapping})()
    loader.config = type("Config", (), small.to_dict())()
    state = model.state_dict()
    tensors = load_file(str(tmp_path / written["file"]))
    assert len(tensors) == len(state)
    for name, tensor in tensors.items():
        back, weight = Served.maybe_remap_mistral(loader, name, tensor)
        assert torch.equal(weight, state[back]), name


def test_a_mistral_format_target_with_experts_is_refused_by_name():
    from eaglet.tools import mistral_format

    with pytest.raises(mistral_format.MistralFormatError, match="moe"):
        mistral_format.params({"dim": 8, "moe": {"num_experts": 8}}, {"hidden_size": 4})
    with pytest.raises(mistral_format.MistralFormatError, match="experts.0.w1"):
        mistral_format.mistral_name("model.layers.0.mlp.experts.0.w1.weight")


def test_vllms_mistral_parser_prepares_a_chat_request_with_the_installed_mistral_common(files):
    """vLLM 0.32's mistral parser builds a mistral_common grammar for every request to a
    v11+ Tekken target; mistral_common 1.13 changed that call's arguments, and every request
    then failed with HTTP 400 (pyproject.toml pins the release vLLM calls)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.reasoning import ReasoningParserManager
    from vllm.tokenizers.mistral import MistralTokenizer

    parser = ReasoningParserManager.get_reasoning_parser("mistral")(
        MistralTokenizer.from_pretrained(str(files))
    )
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}])
    grammar = parser.adjust_request(request).structured_outputs.grammar
    assert "think" in grammar


def test_a_system_prompt_of_content_parts_is_a_valid_setting_and_renders_its_thinking(tekken):
    """generate.system_prompt may be content parts, as a Mistral-format reasoning model's
    card sends its thinking instructions: mistral_common renders the thinking part inside
    [THINK] and [/THINK] in the system turn."""
    from eaglet.core.config import validate
    from eaglet.data.template_check import render_ids
    from eaglet.stages.generate.run import build_messages

    parts = [
        {"type": "text", "text": "Think first, in this form:"},
        {"type": "thinking", "thinking": "your draft"},
    ]
    validate({"generate": {"system_prompt": parts}})
    messages = build_messages({"messages": [{"role": "user", "content": "Hi"}]}, parts)
    ids = render_ids(tekken, messages, True)
    system = ids[ids.index(17) : ids.index(18)]  # [SYSTEM_PROMPT] ... [/SYSTEM_PROMPT]
    assert 34 in system and 35 in system


def test_the_replay_keeps_of_each_draft_what_the_mistral_parsers_grammar_lets_through(files):
    """vLLM checks every draft of a request the mistral parser attached its grammar to, and
    drops the tokens the grammar refuses: an instruction token in an answer is refused, the
    answer's own tokens are kept. A parser that attaches no grammar gives no filter."""
    from eaglet.engine.grammar import draft_filter

    keep_for = draft_filter(files, "mistral")
    tokenizer = load_tokenizer(files)
    answer = [34, *tokenizer.encode("I think.", add_special_tokens=False), 35]
    answer += tokenizer.encode("Yes.", add_special_tokens=False) + [2]
    keep = keep_for([1, 3, 22177, 4], answer)
    assert keep(2, answer[:3]) == answer[:3]  # the first three tokens of the answer
    assert keep(3, [answer[2], 3, answer[3]]) == [answer[2]]  # [INST] cut
    assert keep(4, [3, 4]) == []
    assert draft_filter(STANDINS / "qwen3-8b", "qwen3") is None
