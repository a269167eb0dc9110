"""The stand-ins of real targets' hub files (tests/standins/): they load the way the real
files load (transformers, vLLM's own loader), carry the real special tokens at the real
ids, render the real chat formats with thinking on and off, and vLLM's reasoning parsers
split an answer rendered in them."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.paths import STANDINS

KIMI = STANDINS / "kimi-k2.5"
QWEN = STANDINS / "qwen3-8b"

KIMI_SYSTEM = (
    "<|im_system|>system<|im_middle|>"
    "You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
)
# what a request to vLLM's OpenAI server looks like to a reasoning parser
REQUEST = SimpleNamespace(include_reasoning=True, tools=None, tool_choice=None)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def added_tokens(folder: Path) -> dict[str, int]:
    """The added tokens the folder's tokenizer_config.json declares, content -> id."""
    decoder = read_json(folder / "tokenizer_config.json")["added_tokens_decoder"]
    return {entry["content"]: int(index) for index, entry in decoder.items()}


@pytest.fixture(scope="module")
def kimi():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(KIMI, trust_remote_code=True)


@pytest.fixture(scope="module")
def qwen():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(QWEN)


# -- configs ----------------------------------------------------------------------------


def test_kimi_config_is_the_published_wrapper_with_its_language_model_in_text_config():
    config = read_json(KIMI / "config.json")
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert config["model_type"] == "kimi_k25"
    assert config["media_placeholder_token_id"] == 163605
    assert config["auto_map"]["AutoConfig"] == "configuration_kimi_k25.KimiK25Config"
    assert config["vision_config"]["vt_num_hidden_layers"] == 27
    text = config["text_config"]
    assert text["model_type"] == "kimi_k2"
    assert (text["num_hidden_layers"], text["hidden_size"], text["vocab_size"]) == (
        61,
        7168,
        163840,
    )
    assert (
        text["q_lora_rank"],
        text["kv_lora_rank"],
        text["qk_rope_head_dim"],
        text["qk_nope_head_dim"],
        text["v_head_dim"],
    ) == (1536, 512, 64, 128, 128)
    assert (
        text["topk_method"],
        text["scoring_func"],
        text["n_routed_experts"],
        text["num_experts_per_tok"],
        text["n_shared_experts"],
        text["first_k_dense_replace"],
    ) == ("noaux_tc", "sigmoid", 384, 8, 1, 1)
    assert text["rope_scaling"]["type"] == "yarn" and text["rope_scaling"]["factor"] == 64.0
    quant = text["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors" and quant["format"] == "pack-quantized"
    weights = quant["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["type"]) == (4, 32, "int")
    # a turn ends at <|im_end|>, not at config.json's [EOS]
    generation = read_json(KIMI / "generation_config.json")
    assert generation["eos_token_id"] == added_tokens(KIMI)["<|im_end|>"]


def test_kimi_config_loads_through_its_auto_map_and_natively():
    """With trust_remote_code transformers runs the folder's configuration_kimi_k25.py, as it
    runs the hub's; the language model is a DeepSeek-V3 config either way."""
    from transformers import CONFIG_MAPPING, AutoConfig, DeepseekV3Config

    remote = AutoConfig.from_pretrained(KIMI, trust_remote_code=True)
    assert type(remote).__name__ == "KimiK25Config"
    assert type(remote).__module__.endswith("configuration_kimi_k25")
    assert isinstance(remote.text_config, DeepseekV3Config)
    assert remote.text_config.kv_lora_rank == 512 and remote.text_config.num_hidden_layers == 61
    assert remote.media_placeholder_token_id == 163605
    assert remote.quantization_config["quant_method"] == "compressed-tensors"
    if "kimi_k25" in CONFIG_MAPPING:  # transformers 5.19 knows the wrapper itself
        native = AutoConfig.from_pretrained(KIMI, trust_remote_code=False)
        assert type(native).__name__ == "Kimi_K25Config"
        assert isinstance(native.text_config, DeepseekV3Config)
        assert native.text_config.q_lora_rank == 1536
    else:
        with pytest.raises(ValueError, match="trust_remote_code"):
            AutoConfig.from_pretrained(KIMI, trust_remote_code=False)


def test_qwen_config_has_the_published_numbers():
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(QWEN)
    assert type(config).__name__ == "Qwen3Config" and config.architectures == ["Qwen3ForCausalLM"]
    assert (
        config.num_hidden_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.intermediate_size,
        config.vocab_size,
    ) == (36, 4096, 32, 8, 128, 12288, 151936)
    assert config.tie_word_embeddings is False
    assert read_json(QWEN / "generation_config.json")["eos_token_id"] == [151645, 151643]


# -- tokenizers -------------------------------------------------------------------------


def test_kimi_tokenizer_is_the_folders_code_and_only_with_trust_remote_code(kimi):
    """With trust_remote_code: the folder's TikTokenTokenizer. Without it transformers 5.19
    does not refuse: it resolves kimi_k25 to its generic TokenizersBackend, which converts
    tiktoken.model with a GPT-4-style split and tokenizes some text ("I don't know")
    differently; the real files do the same (README.md). Loading that conversion takes
    tens of seconds here (the vocabulary's gap becomes added tokens), so the resolution is
    checked, not the load."""
    from transformers import AutoConfig
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    assert type(kimi).__name__ == "TikTokenTokenizer"
    assert type(kimi).__module__.endswith("tokenization_kimi")
    assert read_json(KIMI / "tokenizer_config.json")["auto_map"]["AutoTokenizer"][0] == (
        "tokenization_kimi.TikTokenTokenizer"
    )
    try:
        native = AutoConfig.from_pretrained(KIMI, trust_remote_code=False)
    except ValueError as error:  # a transformers without kimi_k25 refuses outright
        assert "trust_remote_code" in str(error)
        return
    without = TOKENIZER_MAPPING.get(type(native), None)
    assert without is not None and "TikTokenTokenizer" not in str(without)


@pytest.mark.parametrize("folder", [KIMI, QWEN], ids=["kimi", "qwen"])
def test_special_tokens_encode_to_single_tokens_at_their_real_ids(folder, kimi, qwen):
    tokenizer = kimi if folder == KIMI else qwen
    tokens = added_tokens(folder)
    config = read_json(folder / "config.json")
    vocab_size = config.get("text_config", config)["vocab_size"]
    assert max(tokens.values()) < vocab_size and len(tokenizer) <= vocab_size
    for content, index in tokens.items():
        assert tokenizer.encode(content, add_special_tokens=False) == [index], content
        assert tokenizer.convert_tokens_to_ids(content) == index, content
        assert tokenizer.decode([index]) == content, content
    named = {
        "kimi": {
            "<|im_end|>": 163586,
            "<|im_middle|>": 163601,
            "<think>": 163606,
            "</think>": 163607,
            "<|media_pad|>": 163605,
            "[EOS]": 163585,
        },
        "qwen": {
            "<|endoftext|>": 151643,
            "<|im_start|>": 151644,
            "<|im_end|>": 151645,
            "<think>": 151667,
            "</think>": 151668,
        },
    }["kimi" if folder == KIMI else "qwen"]
    assert {k: tokens[k] for k in named} == named


def test_kimi_encodes_like_the_hub_tokenizer(kimi):
    """encode(text) alone reads special-token text and adds no BOS, and agrees with the
    transformers path; Kimi's split keeps a contraction on its word (GPT-4's and Qwen's cut
    it off); ids in the gap below the special block decode to [UNK] instead of failing."""
    text = "<|im_user|>user<|im_middle|>Say 中文 twice, don't you?<|im_end|>"
    ids = kimi.encode(text)
    assert ids == kimi.encode(text, add_special_tokens=False) == kimi(text)["input_ids"]
    assert ids[0] == 163587 and ids[-1] == 163586 and kimi.bos_token_id not in ids
    assert kimi.decode(ids) == text
    assert kimi.decode(ids, skip_special_tokens=True) == "userSay 中文 twice, don't you?"
    assert "Ġdon't" in kimi.convert_ids_to_tokens(kimi.encode("I don't know"))
    assert kimi.decode([100_000]) == "[UNK]"
    assert len(STANDINS.joinpath("kimi-k2.5", "tiktoken.model").read_bytes()) < 1_000_000


# -- chat templates ---------------------------------------------------------------------


def test_kimi_generation_prompt_opens_the_reasoning_and_thinking_false_closes_it(kimi):
    messages = [{"role": "user", "content": "Add 2 and 2."}]
    head = KIMI_SYSTEM + "<|im_user|>user<|im_middle|>Add 2 and 2.<|im_end|>"
    # the hub tokenizer's defaults: text, with the generation prompt, thinking on
    assert (
        kimi.apply_chat_template(messages) == head + "<|im_assistant|>assistant<|im_middle|><think>"
    )
    assert (
        kimi.apply_chat_template(messages, thinking=False)
        == head + "<|im_assistant|>assistant<|im_middle|><think></think>"
    )
    ids = kimi.apply_chat_template(messages, tokenize=True, return_dict=False)
    opening = [163588, *kimi.encode("assistant"), 163601, 163606]
    assert ids[-len(opening) :] == opening
    # a given system message replaces the default one
    own = kimi.apply_chat_template([{"role": "system", "content": "Be brief."}, *messages])
    assert own.startswith("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>")


def test_kimi_drops_reasoning_up_to_the_last_plain_answer_and_keeps_it_after(kimi):
    first = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
        {"role": "user", "content": "2+2?"},
    ]
    assert kimi.apply_chat_template(first) == (
        KIMI_SYSTEM + "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Hello!<|im_end|>"
        "<|im_user|>user<|im_middle|>2+2?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    call = {
        "id": "functions.add:0",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'},
    }
    steps = [
        *first,
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "use the tool",
            "tool_calls": [call],
        },
        {"role": "tool", "name": "add", "tool_call_id": "functions.add:0", "content": "4"},
    ]
    tail = (
        "<|im_assistant|>assistant<|im_middle|><think>{r}</think><|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>{{"a": 2, "b": 2}}'
        "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
        "<|im_system|>add<|im_middle|>## Return of functions.add:0\n4<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>{g}"
    )
    assert kimi.apply_chat_template(steps).endswith(tail.format(r="use the tool", g=""))
    assert kimi.apply_chat_template(steps, thinking=False).endswith(tail.format(r="", g="</think>"))
    # a finished answer is the last plain assistant message: its reasoning is not rendered
    done = kimi.apply_chat_template(
        [first[0], {"role": "assistant", "content": "4", "reasoning_content": "add"}],
        add_generation_prompt=False,
    )
    assert done.endswith("<|im_assistant|>assistant<|im_middle|><think></think>4<|im_end|>")


def test_qwen_template_is_chatml_with_enable_thinking(qwen):
    messages = [{"role": "user", "content": "Add 2 and 2."}]
    head = "<|im_start|>user\nAdd 2 and 2.<|im_end|>\n<|im_start|>assistant\n"
    assert qwen.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == head
    assert (
        qwen.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        == head + "<think>\n\n</think>\n\n"
    )
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add"},
    ]
    assert qwen.apply_chat_template(conversation, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nadd\n</think>\n\n4<|im_end|>\n"
    )
    # reasoning written inline in the content is read the same way
    inline = [conversation[3], {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}]
    assert qwen.apply_chat_template(inline, tokenize=False).endswith(
        "<|im_start|>assistant\n<think>\nadd\n</think>\n\n4<|im_end|>\n"
    )
    tool_turn = [
        conversation[3],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}
            ],
        },
        {"role": "tool", "content": "4"},
    ]
    assert qwen.apply_chat_template(tool_turn, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
        '{"name": "add", "arguments": {"a": 2}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen_vocabulary_files_agree():
    """tokenizer.json's BPE is vocab.json plus the added tokens, with merges.txt's merges."""
    document = read_json(QWEN / "tokenizer.json")
    vocab = read_json(QWEN / "vocab.json")
    model_vocab = document["model"]["vocab"]
    assert {k: v for k, v in model_vocab.items() if k not in added_tokens(QWEN)} == vocab
    merges = (QWEN / "merges.txt").read_text().splitlines()[1:]
    assert [" ".join(pair) for pair in document["model"]["merges"]] == merges
    assert {t["content"]: t["id"] for t in document["added_tokens"]} == added_tokens(QWEN)


# -- vLLM -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_tokenizers():
    """Both stand-ins loaded by vLLM's own tokenizer loader (the one its server uses)."""
    registry = pytest.importorskip("vllm.tokenizers")
    return {
        "kimi": registry.get_tokenizer(str(KIMI), trust_remote_code=True),
        "qwen": registry.get_tokenizer(str(QWEN)),
    }


def test_vllm_loads_both_and_keeps_the_template_variables(vllm_tokenizers):
    """vLLM reads the configs with its own classes (the wrapper's language model in
    text_config), loads the tokenizers, and passes thinking switches on to the templates."""
    from vllm.renderers.hf import resolve_chat_template_kwargs
    from vllm.transformers_utils.config import get_config

    wrapper = get_config(str(KIMI), trust_remote_code=True)
    assert type(wrapper).__name__ == "Kimi_K25Config"
    assert wrapper.media_placeholder_token_id == 163605
    assert wrapper.get_text_config().kv_lora_rank == 512
    assert get_config(str(QWEN), trust_remote_code=False).num_key_value_heads == 8
    kimi, qwen = vllm_tokenizers["kimi"], vllm_tokenizers["qwen"]
    assert "TikTokenTokenizer" in [c.__name__ for c in type(kimi).__mro__]
    assert kimi.max_token_id == 163839 and qwen.max_token_id == 151668
    # vLLM passes a request's chat_template_kwargs on only if the template reads them
    off = {"thinking": False}
    assert resolve_chat_template_kwargs(kimi, kimi.chat_template, off) == off
    off = {"enable_thinking": False}
    assert resolve_chat_template_kwargs(qwen, qwen.chat_template, off) == off


def test_vllm_reasoning_parsers_split_an_answer_in_each_format(vllm_tokenizers):
    from vllm.reasoning import ReasoningParserManager

    kimi, qwen = vllm_tokenizers["kimi"], vllm_tokenizers["qwen"]
    k2 = ReasoningParserManager.get_reasoning_parser("kimi_k2")
    answer = kimi.encode("Two and two make four.</think>It is 4.<|im_end|>")
    text = kimi.decode(answer[:-1])  # what the server parses: the completion before its stop
    thinking = k2(kimi, chat_template_kwargs={})
    assert thinking.extract_reasoning(text, REQUEST) == ("Two and two make four.", "It is 4.")
    assert thinking.is_reasoning_end(answer)
    assert thinking.extract_content_ids(answer[:-1]) == kimi.encode("It is 4.")
    off = k2(kimi, chat_template_kwargs={"thinking": False})
    assert off.extract_reasoning("It is 4.", REQUEST) == (None, "It is 4.")

    q3 = ReasoningParserManager.get_reasoning_parser("qwen3")
    reasoning, content = q3(qwen, chat_template_kwargs={}).extract_reasoning(
        qwen.decode(qwen.encode("<think>\nTwo and two make four.\n</think>\n\nIt is 4.")), REQUEST
    )
    assert (reasoning.strip(), content.strip()) == ("Two and two make four.", "It is 4.")
    assert q3(qwen, chat_template_kwargs={"enable_thinking": False}).extract_reasoning(
        "It is 4.", REQUEST
    ) == (None, "It is 4.")


# -- DeepSeek-R1-Distill-Qwen and Gemma 4 -------------------------------------------------

R1 = STANDINS / "deepseek-r1-distill-qwen-7b"
GEMMA = STANDINS / "gemma-4-e2b-it"


@pytest.mark.parametrize("folder", [R1, GEMMA], ids=["r1-distill", "gemma-4"])
def test_the_other_stand_ins_load_and_keep_their_tokens_at_their_ids(folder):
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    for content, index in added_tokens(folder).items():
        assert tokenizer.convert_tokens_to_ids(content) == index, content
        assert tokenizer(content, add_special_tokens=False)["input_ids"] == [index], content
    text = "Hello world, I don't know. Ünïcödé 中文 12345"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    config = AutoConfig.from_pretrained(folder)
    assert config.get_text_config().vocab_size > max(added_tokens(folder).values())


def test_r1_opens_the_reasoning_in_the_prompt_and_drops_it_from_the_history():
    from transformers import AutoTokenizer

    r1 = AutoTokenizer.from_pretrained(R1)
    config = read_json(R1 / "config.json")
    assert (config["architectures"], config["num_hidden_layers"], config["vocab_size"]) == (
        ["Qwen2ForCausalLM"],
        28,
        152064,
    )
    assert read_json(R1 / "generation_config.json")["eos_token_id"] == 151643
    user = [{"role": "user", "content": "Hi"}]
    assert r1.apply_chat_template(user, tokenize=False, add_generation_prompt=True) == (
        "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>\n"
    )
    history = user + [
        {
            "role": "assistant",
            "content": "<think>\nHm.\n</think>\n\nHello.",
            "reasoning_content": "Hm.",
        },
        {"role": "user", "content": "Bye"},
    ]
    assert r1.apply_chat_template(history, tokenize=False, add_generation_prompt=True) == (
        "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜>\n\nHello.<｜end▁of▁sentence｜>"
        "<｜User｜>Bye<｜Assistant｜><think>\n"
    )


def test_gemma_turns_thinking_and_history_follow_the_published_format():
    from transformers import AutoTokenizer

    gemma = AutoTokenizer.from_pretrained(GEMMA)
    text = read_json(GEMMA / "config.json")["text_config"]
    assert read_json(GEMMA / "config.json")["architectures"] == ["Gemma4ForConditionalGeneration"]
    assert (text["num_hidden_layers"], text["hidden_size"], text["vocab_size"]) == (
        30,
        2304,
        262144,
    )
    turn_end = gemma.convert_tokens_to_ids("<turn|>")
    assert turn_end in read_json(GEMMA / "generation_config.json")["eos_token_id"]
    user = [{"role": "user", "content": "Hi"}]
    assert gemma.apply_chat_template(
        user, tokenize=False, add_generation_prompt=True, enable_thinking=True
    ) == ("<bos><|turn>system\n<|think|><turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n")
    assert gemma.apply_chat_template(user, tokenize=False, add_generation_prompt=True) == (
        "<bos><|turn>user\nHi<turn|>\n<|turn>model\n"
    )
    history = user + [
        {"role": "assistant", "content": "Hello.", "reasoning_content": "Hm."},
        {"role": "user", "content": "Bye"},
    ]
    assert "Hm." not in gemma.apply_chat_template(
        history, tokenize=False, add_generation_prompt=True
    )
