"""The exported drafter against the real engine: vLLM CPU loads it for the real embedded target
with EAGLE-3 speculation and drafts with it.

The drafter is untrained (random layer, lm_head from the target's rows): what is proven here
is the checkpoint format, the config vLLM reads and the d2t mapping it needs for a reduced
vocabulary, not acceptance.
"""

from __future__ import annotations

import json
import re
import urllib.request

import pytest
import torch
from safetensors.torch import save
from transformers import AutoTokenizer

from eaglet.config import validate
from eaglet.drafter import DrafterConfig, Eagle3Drafter, init_lm_head
from eaglet.export import export_drafter, load_drafter
from eaglet.io import atomic_open
from eaglet.server import VLLMServer, server_args
from eaglet.target import (load_target_embedding, load_target_lm_head, prepare_target,
                           read_target_config)

pytestmark = pytest.mark.e2e

DRAFT_VOCAB = 4096
K = 3
PROMPTS = ["Write a Python function that returns the sum of a list.",
           "What is the capital of France? Answer in one sentence.",
           "Count from one to ten in words."]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("target")
    prepare_target("embedded:smollm2-135m-instruct", directory)
    return directory


def draft_vocabulary(target_dir) -> torch.Tensor:
    """Target ids of the draft vocabulary: every token of the prompts rendered through the chat
    template, filled up with the lowest ids (sorted)."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    seen = set()
    for prompt in PROMPTS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             add_generation_prompt=True, tokenize=False)
        seen.update(tokenizer(text, add_special_tokens=False)["input_ids"])
    ids = sorted(seen)
    fill = (i for i in range(len(tokenizer)) if i not in seen)
    while len(ids) < DRAFT_VOCAB:
        ids.append(next(fill))
    return torch.tensor(sorted(ids))


def metric(text: str, name: str) -> float:
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$",
                                                     text, re.MULTILINE)]
    assert values, f"{name} missing from /metrics"
    return sum(values)


def test_vllm_loads_and_drafts_with_the_exported_drafter(target_dir, tmp_path):
    config = read_target_config(target_dir)
    vocab = config["vocab_size"]
    target_ids = draft_vocabulary(target_dir)
    d2t = target_ids - torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    layers = config["num_hidden_layers"]
    aux = [2, layers // 2, layers - 3]  # vLLM's default for EAGLE-3

    torch.manual_seed(0)
    embed = load_target_embedding(target_dir)
    model = Eagle3Drafter(DrafterConfig.from_target(config, DRAFT_VOCAB, aux), embed, d2t, t2d)
    init_lm_head(model, load_target_lm_head(target_dir, target_ids))
    drafter_dir = tmp_path / "drafter"
    written = export_drafter(model, drafter_dir)
    assert written["vocab_size"] == vocab == 49152 and written["hidden_size"] == 576
    reloaded = load_drafter(drafter_dir, target_dir)
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    with atomic_open(tmp_path / "vocab_map.safetensors", "wb") as handle:  # as the vocab stage writes it
        handle.write(save({"d2t": d2t, "t2d": t2d}))

    cfg = validate({"target": {"dtype": "float32", "max_model_len": 1024},
                    "server": {"memory_utilization": 0.4, "enforce_eager": True}})
    speculative = {"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": K}
    args = server_args(cfg["target"], cfg["server"], "target") + [
        "--speculative-config", json.dumps(speculative)]
    with VLLMServer(str(target_dir), tmp_path / "server.log", args=args,
                    startup_timeout_s=600) as server:
        for prompt in PROMPTS:
            body = json.dumps({"model": "target", "temperature": 0, "max_tokens": 48,
                               "messages": [{"role": "user", "content": prompt}]}).encode()
            request = urllib.request.Request(server.url + "/v1/chat/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as response:
                answer = json.loads(response.read())
            assert answer["choices"][0]["message"]["content"].strip()
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as response:
            metrics = response.read().decode()
    log_text = (tmp_path / "server.log").read_text()
    assert "Resolved architecture: LlamaForCausalLMEagle3" in log_text
    assert "without its own embed_tokens" in log_text  # the target's embedding is shared
    drafts = metric(metrics, "vllm:spec_decode_num_drafts_total")
    draft_tokens = metric(metrics, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    per_position = metric(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert drafts > 0 and draft_tokens == K * drafts
    assert 0 <= accepted <= draft_tokens and per_position == accepted
    print(f"drafts {drafts:.0f}, draft tokens {draft_tokens:.0f}, accepted {accepted:.0f}, "
          f"mean acceptance length {1 + accepted / drafts:.3f}")
