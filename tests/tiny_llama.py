"""A tiny random Llama for tests that need a real target, and synthetic records for it.

``greedy_records`` makes completions the model really produces at temperature 0 (a manual
argmax loop in float32, re-running the whole sequence at every step as extraction does), so
the extracted teacher agrees with them; ``random_records`` makes completions of random tokens.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 300
LAYERS = 6
HIDDEN = 64


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one thread: a model this small gains nothing from more, and on a busy
    2-core machine OpenMP's spinning workers make each forward about 20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
    )


def make_tiny_llama(out_dir: str | Path | None = None, seed: int = 0) -> LlamaForCausalLM:
    """A seeded random ``LlamaForCausalLM`` in float32 eval mode, saved to ``out_dir`` if given."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config()).float().eval()
    if out_dir is not None:
        model.save_pretrained(out_dir)
    return model


@torch.inference_mode()
def greedy_completion(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(new_tokens):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def record(rid: str, prompt: list[int], completion: list[int], temperature: float = 0.0) -> dict:
    return {
        "id": rid,
        "prompt_token_ids": list(prompt),
        "completion_token_ids": list(completion),
        "sampling": {"temperature": temperature},
    }


def random_prompts(n: int, seed: int, min_len: int = 3, max_len: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def greedy_records(
    model, n: int = 6, seed: int = 0, new_tokens=(6, 14), prefix: str = "p-greedy"
) -> list[dict]:
    rng = random.Random(seed + 1)
    return [
        record(f"{prefix}-{i}", prompt, greedy_completion(model, prompt, rng.randint(*new_tokens)))
        for i, prompt in enumerate(random_prompts(n, seed))
    ]


def random_records(
    n: int = 4,
    seed: int = 100,
    new_tokens=(6, 14),
    temperature: float = 0.0,
    prefix: str = "p-random",
) -> list[dict]:
    rng = random.Random(seed + 1)
    return [
        record(
            f"{prefix}-{i}",
            prompt,
            [rng.randrange(VOCAB) for _ in range(rng.randint(*new_tokens))],
            temperature,
        )
        for i, prompt in enumerate(random_prompts(n, seed))
    ]
