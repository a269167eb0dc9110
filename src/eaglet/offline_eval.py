"""Offline acceptance: eaglet's own PyTorch replay of vLLM's greedy EAGLE-3 drafting.

Given the target's greedy continuation of each prompt, run the target once (transformers) for
its aux features, then replay the serving loop: at a round whose last verified position is
``p`` (the target has just produced token ``p+1``), the drafter chains ``k`` draft tokens
from row ``p`` (step 0 reads the target's features of ``p`` and the embedding of token
``p+1``; step j reads its own previous hidden state and its own previous draft, at RoPE
position ``p+j``, attending to step-0 keys of rows <= p and to its own chain). The target
accepts the longest prefix that matches its own greedy tokens and adds one token of its own,
so the next round starts at ``p + accepted + 1``. Counts are kept the way vLLM's metrics keep
them (drafts, draft tokens, accepted tokens, accepted per position), so the acceptance length
compares one to one with the `evaluate` stage's and proves the export, the aux layer ids and
the d2t mapping end to end; it also evaluates a drafter where no vLLM is available.
"""

from __future__ import annotations

import logging

import torch

from eaglet.drafter import Eagle3Drafter, attention_blocks
from eaglet.extract import AuxCapture, decoder_layers

log = logging.getLogger("eaglet.offline_eval")


@torch.inference_mode()
def target_features(model, layer_ids: list[int], ids: list[int]) -> torch.Tensor:
    """Aux features [N, 3H] of one sequence."""
    capture = AuxCapture(decoder_layers(model), layer_ids)
    try:
        model.get_decoder()(input_ids=torch.tensor([ids]), use_cache=False)
        return torch.cat(capture.take(), dim=-1)[0]
    finally:
        capture.close()


@torch.inference_mode()
def draft_chain(drafter: Eagle3Drafter, aux: torch.Tensor, ids: torch.Tensor, p: int,
                k: int) -> list[int]:
    """``k`` greedy draft tokens (target ids) from row ``p``; ``ids`` is the sequence."""
    rows = p + 1
    positions = torch.arange(rows)
    blocks = attention_blocks(torch.zeros(rows, dtype=torch.long))  # one sample: causal
    hidden = drafter.fc(aux[:rows])                               # [rows, H]
    step_ids = ids[1:rows + 1].clone()                            # row t embeds token t+1
    cache: list[tuple[torch.Tensor, torch.Tensor]] = []
    drafts = []
    for step in range(k):
        cos, sin = drafter.rope(positions + step)
        embeds = drafter.embed_tokens[step_ids].to(hidden.dtype)
        hidden = drafter.midlayer(embeds, hidden, cos, sin, blocks, cache)
        draft = int(drafter.to_target_ids(drafter.lm_head(drafter.norm(hidden[p])).argmax()))
        drafts.append(draft)
        step_ids = step_ids.clone()
        step_ids[p] = draft  # only row p's chain matters after step 0
    return drafts


def replay(draft, ids: list[int], prompt_len: int, k: int) -> dict:
    """vLLM's counters for one greedy sequence (prompt + the target's own continuation);
    ``draft(p, k)`` returns the k draft tokens proposed from row ``p``."""
    n = len(ids)
    counts = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_position": [0] * k}
    p = prompt_len - 1           # after prefill the target has produced token prompt_len
    while p + 2 < n:             # at least one token left to draft for
        drafts = draft(p, k)
        accepted = 0
        for j, token in enumerate(drafts):
            if p + 2 + j < n and token == ids[p + 2 + j]:
                accepted += 1
            else:
                break
        counts["drafts"] += 1
        counts["draft_tokens"] += k
        counts["accepted"] += accepted
        for j in range(accepted):
            counts["per_position"][j] += 1
        p += accepted + 1
    return counts


def offline_acceptance(target_model, drafter: Eagle3Drafter,
                       sequences: list[tuple[list[int], list[int]]], k: int) -> dict:
    """Acceptance over ``(prompt_ids, completion_ids)`` pairs, as vLLM would count it."""
    total = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_position": [0] * k}
    layer_ids = drafter.config.aux_layer_ids
    for prompt_ids, completion_ids in sequences:
        ids = list(prompt_ids) + list(completion_ids)
        aux = target_features(target_model, layer_ids, ids).to(drafter.fc.weight.dtype)
        seq = torch.tensor(ids)
        counts = replay(lambda p, n: draft_chain(drafter, aux, seq, p, n), ids,
                        len(prompt_ids), k)
        for key in ("drafts", "draft_tokens", "accepted"):
            total[key] += counts[key]
        total["per_position"] = [a + b for a, b in zip(total["per_position"], counts["per_position"])]
    drafts = total["drafts"]
    return {
        "k": k, **total,
        "acceptance_length": 1 + total["accepted"] / drafts if drafts else None,
        "acceptance_rate": total["accepted"] / total["draft_tokens"] if drafts else None,
        "per_position_rate": [c / drafts for c in total["per_position"]] if drafts else [],
    }


@torch.inference_mode()
def greedy_continuations(target_model, prompts: list[list[int]], max_tokens: int,
                         eos_ids: set[int]) -> list[list[int]]:
    """The target's greedy answers with transformers, for machines without vLLM."""
    out = []
    for prompt in prompts:
        generated = target_model.generate(torch.tensor([prompt]), do_sample=False,
                                          max_new_tokens=max_tokens,
                                          eos_token_id=sorted(eos_ids) or None)
        completion = generated[0, len(prompt):].tolist()
        out.append(completion)
    return out
