"""The offline acceptance replay: against an oracle drafter, against a plain reference of the
chain on the drafter's own TTT forward, and end to end on a tiny target."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eaglet.drafter import DrafterConfig, Eagle3Drafter
from eaglet.offline_eval import draft_chain, offline_acceptance, replay, target_features

V, H = 96, 32


def tiny_drafter(seed: int = 0, aux_layer_ids=(0, 1, 2)) -> Eagle3Drafter:
    torch.manual_seed(seed)
    config = DrafterConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                           rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                           max_position_embeddings=256, vocab_size=V, draft_vocab_size=48,
                           target_hidden_size=H, aux_layer_ids=list(aux_layer_ids))
    draft_ids = torch.arange(0, V, 2)                     # every other target id
    d2t = draft_ids - torch.arange(len(draft_ids))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    model = Eagle3Drafter(config, torch.randn(V, H), d2t, t2d)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return model.eval()


def test_an_oracle_drafter_reaches_k_plus_one():
    prompt_len, k = 5, 3
    ids = list(range(38))  # 33 completion tokens: the first, then 8 rounds of k+1
    oracle = lambda p, n: ids[p + 2:p + 2 + n]  # noqa: E731  (the target's own greedy tokens)
    counts = replay(oracle, ids, prompt_len, k)
    assert counts["drafts"] == 8 and counts["accepted"] == 8 * k
    assert counts["per_position"] == [8, 8, 8]
    assert 1 + counts["accepted"] / counts["drafts"] == k + 1


def test_a_drafter_that_is_always_wrong_gets_nothing_accepted():
    ids = list(range(30))
    counts = replay(lambda p, n: [-1] * n, ids, 4, 3)
    assert counts["accepted"] == 0 and counts["drafts"] == len(ids) - 4 - 1


def reference_chain(drafter: Eagle3Drafter, aux, ids, p: int, k: int) -> list[int]:
    """Plainly: run the drafter's full TTT forward over rows 0..p with 1, 2, ..., k steps,
    writing each new draft into the next step's input at row p."""
    rows = p + 1
    steps = [ids[1:rows + 1].clone()]
    drafts = []
    for _ in range(k):
        logits = drafter(aux[:rows], torch.stack(steps), torch.arange(rows),
                         torch.zeros(rows, dtype=torch.long))
        draft = int(drafter.to_target_ids(logits[-1][p].argmax()))
        drafts.append(draft)
        nxt = steps[-1].clone()
        nxt[p] = draft
        steps.append(nxt)
    return drafts


@torch.inference_mode()
def test_draft_chain_matches_the_ttt_forward_reference():
    drafter = tiny_drafter()
    torch.manual_seed(1)
    ids = torch.randint(0, V, (24,))
    aux = torch.randn(24, 3 * H)
    for p in (0, 5, 17, 22):
        assert draft_chain(drafter, aux, ids, p, 4) == reference_chain(drafter, aux, ids, p, 4)
    drafts = draft_chain(drafter, aux, ids, 10, 4)
    assert all(d % 2 == 0 for d in drafts)  # mapped through d2t into the draft vocabulary


@torch.inference_mode()
def test_offline_acceptance_counts_satisfy_vllms_identities():
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(hidden_size=H, intermediate_size=64,
                                          num_hidden_layers=3, num_attention_heads=4,
                                          num_key_value_heads=2, vocab_size=V,
                                          max_position_embeddings=256)).eval()
    drafter = tiny_drafter()
    prompts = [[1, 5, 7, 9], [3, 4]]
    sequences = []
    for prompt in prompts:
        out = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12,
                              pad_token_id=0)
        sequences.append((prompt, out[0, len(prompt):].tolist()))
    result = offline_acceptance(target, drafter, sequences, k=3)
    assert result["drafts"] > 0 and result["draft_tokens"] == 3 * result["drafts"]
    assert result["acceptance_length"] == pytest.approx(1 + sum(result["per_position_rate"]))
    rates = result["per_position_rate"]
    assert all(a >= b for a, b in zip(rates, rates[1:]))  # a later position needs the earlier
    assert target_features(target, [0, 1, 2], [1, 2, 3]).shape == (3, 3 * H)
