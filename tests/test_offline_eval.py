"""The offline acceptance replay: against an oracle drafter, against a plain reference of the
chain on the drafter's own TTT forward, and end to end on a tiny target."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eaglet.drafter import DrafterConfig, Eagle3Drafter, attention_blocks
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


# -- replay from the held-out shard's stored states ------------------------------------------

LAYERS = [0, 1, 2]


def tiny_target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        vocab_size=V, max_position_embeddings=256)).eval()


@torch.inference_mode()
def greedy(target, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[list, list]]:
    return [(p, target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new_tokens,
                                pad_token_id=0)[0, len(p):].tolist()) for p in prompts]


def prompts_of(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (int(torch.randint(3, 10, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def write_held_out(path, target, samples: list[tuple[list, list]], dtype: str) -> None:
    """A held-out shard as extraction writes it: each sample's prompt + answer with the
    target's aux states of every row (the final states and teacher are not read here)."""
    from eaglet import shards

    ids, mask, offsets, aux = [], [], [0], []
    for prompt, answer in samples:
        ids += prompt + answer
        mask += [0] * len(prompt) + [1] * len(answer)
        offsets.append(len(ids))
        aux.append(target_features(target, LAYERS, prompt + answer))
    n = len(ids)
    shards.write(path, torch.tensor(ids), torch.tensor(mask), torch.tensor(offsets),
                 torch.full((n,), -1), torch.cat(aux), torch.zeros(n, H),
                 sample_ids=[f"s{i}" for i in range(len(samples))], aux_layer_ids=LAYERS,
                 dtype=dtype, target={})


def fitted_drafter(target, samples: list[tuple[list, list]], seed: int = 0,
                   steps: int = 15) -> Eagle3Drafter:
    """A full-vocabulary drafter whose lm_head is fitted for a few steps to predict each
    row's token after next from its first step's hidden state: it drafts the first token
    right about half the time on these samples, as a trained drafter does (a random one
    accepts nothing, so no replay could tell one source of states from another)."""
    torch.manual_seed(seed)
    config = DrafterConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                           rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                           max_position_embeddings=256, vocab_size=V, draft_vocab_size=V,
                           target_hidden_size=H, aux_layer_ids=LAYERS)
    drafter = Eagle3Drafter(config, target.model.embed_tokens.weight.detach().clone(),
                            torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    for param in drafter.parameters():
        torch.nn.init.normal_(param, std=0.3)
    drafter.eval()
    features, labels = [], []
    with torch.no_grad():
        for prompt, answer in samples:
            ids = prompt + answer
            rows = len(ids) - 2
            cos, sin = drafter.rope(torch.arange(rows))
            blocks = attention_blocks(torch.zeros(rows, dtype=torch.long))
            hidden = drafter.midlayer(drafter.embed_tokens[torch.tensor(ids[1:rows + 1])],
                                      drafter.fc(target_features(target, LAYERS, ids)[:rows]),
                                      cos, sin, blocks, [])
            features.append(drafter.norm(hidden))
            labels.append(torch.tensor(ids[2:]))
    x, y = torch.cat(features), torch.cat(labels)
    weight = torch.zeros(V, H, requires_grad=True)
    optimizer = torch.optim.Adam([weight], lr=0.1)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(x @ weight.T, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        drafter.lm_head.weight.copy_(weight)
    return drafter


@pytest.fixture(scope="module")
def world():
    """A tiny target, its greedy answers of 24 tokens to 8 prompts (what extraction stored),
    evaluation's answers (the same, cut to 16 tokens: evaluate.max_tokens) and a drafter
    fitted on them."""
    target = tiny_target()
    stored = greedy(target, prompts_of(8), 24)
    answers = [(p, a[:16]) for p, a in stored]
    return target, stored, answers, fitted_drafter(target, answers)


def test_replay_from_stored_float32_states_equals_replay_from_a_forward(world, tmp_path):
    from eaglet.offline_eval import Features, StoredStates, replay_sequences

    target, stored, answers, drafter = world
    write_held_out(tmp_path / "shard.safetensors", target, stored, "float32")
    states = StoredStates([tmp_path / "shard.safetensors"])
    ks = [1, 3, 5]
    from_stored = replay_sequences(drafter, answers, ks, Features(LAYERS, states, None))
    loads = []
    from_forward = replay_sequences(drafter, answers, ks, Features(
        LAYERS, None, lambda: loads.append(1) or target))
    assert from_stored["sources"] == {"sequences": 8, "stored": 8, "forward": 0, "left_out": 0}
    assert from_forward["sources"]["forward"] == 8 and loads == [1]  # loaded once, on need
    assert from_stored["counts"] == from_forward["counts"]
    assert all(from_stored["counts"][k]["accepted"] > 0 for k in ks)  # it drafts, and is heard
    # the rows up to the answer's length are the forward's states of the shorter sequence
    prompt, answer = answers[0]
    aux, how = states.find(prompt, answer)
    assert how == "stored" and aux.shape == (len(prompt) + len(answer), 3 * H)
    torch.testing.assert_close(aux, target_features(target, LAYERS, prompt + answer),
                               rtol=1e-5, atol=1e-6)


def test_an_answer_whose_tokens_differ_is_left_out_and_counted(world, tmp_path):
    from eaglet.offline_eval import Features, StoredStates, replay_sequences

    target, stored, answers, drafter = world
    write_held_out(tmp_path / "shard.safetensors", target, stored, "float32")
    states = StoredStates([tmp_path / "shard.safetensors"])
    (p0, a0), (p1, _), (_, a2) = answers[:3]
    changed = [(p0, a0[:5] + [(a0[5] + 1) % V] + a0[6:]),   # sampled: another token at 5
               (p1, stored[1][1] + [7, 8]),                    # longer than the stored answer
               ([95, 94, 93], a2)]                             # a prompt no shard stores
    mixed = answers[3:] + changed
    alone = replay_sequences(drafter, mixed, [3], Features(LAYERS, states, None,
                                                         no_forward="too large"))
    assert alone["sources"] == {"sequences": 8, "stored": 5, "forward": 0, "left_out": 3,
                                "differs": 1, "longer_than_stored": 1, "not_stored": 1}
    # the left-out answers add nothing: the counts are those of the stored ones alone
    assert alone["counts"] == replay_sequences(drafter, answers[3:], [3],
                                               Features(LAYERS, states, None))["counts"]
    # with a target that loads, they are replayed from its forward instead (still counted)
    both = replay_sequences(drafter, mixed, [3], Features(LAYERS, states, lambda: target))
    assert both["sources"] == {"sequences": 8, "stored": 5, "forward": 3, "left_out": 0,
                               "differs": 1, "longer_than_stored": 1, "not_stored": 1}
    assert both["counts"] == replay_sequences(drafter, mixed, [3], Features(
        LAYERS, None, lambda: target))["counts"]


def test_a_target_that_fails_to_load_leaves_the_stored_states_to_replay(world, tmp_path):
    from eaglet.offline_eval import Features, StoredStates, replay_sequences

    target, stored, answers, drafter = world
    write_held_out(tmp_path / "shard.safetensors", target, stored, "float32")

    def no_mapping():
        raise ValueError("Unrecognized configuration class KimiK25Config")

    features = Features(LAYERS, StoredStates([tmp_path / "shard.safetensors"]), no_mapping)
    got = replay_sequences(drafter, answers[:2] + [([95, 94, 93], [1, 2, 3])], [3], features)
    assert got["sources"]["stored"] == 2 and got["sources"]["left_out"] == 1
    assert "KimiK25Config" in features.no_forward and not features.loaded


@pytest.mark.parametrize("dtype, max_flips, max_al_change",
                         [("bfloat16", 0.02, 0.03), ("fp8", 0.06, 0.05)])
def test_states_stored_coarser_than_served_move_the_replay_a_little(world, tmp_path, dtype,
                                                                    max_flips, max_al_change):
    """How far a replay from rounded stored states is from one from a float32 forward (what
    a float32 server's drafter reads), on the tiny world with 4 fitted drafters, drafting k 3
    at every row and replaying at k 1, 3 and 5. Measured: bfloat16 changed 0.2% of the draft
    tokens (3 of 1440) and the acceptance length by at most 1.4%; fp8 2.4% of the draft tokens
    (34) and the acceptance length by at most 3.7%; float32 storage changes nothing (above).
    So where the store is coarser than the server and the target can be loaded, evaluate runs
    the target instead; where it cannot (a 1T target), the replay reads the stored states and
    acceptance.json says so."""
    from eaglet.offline_eval import Features, StoredStates, coarser, draft_chain, replay_sequences

    target, stored, answers, _ = world
    write_held_out(tmp_path / "shard.safetensors", target, stored, dtype)
    states = StoredStates([tmp_path / "shard.safetensors"])
    assert states.dtype == dtype and coarser(dtype, "float32") and not coarser(dtype, dtype)
    flips = drafted = 0
    al_change = 0.0
    al = lambda got, k: 1 + got["counts"][k]["accepted"] / got["counts"][k]["drafts"]  # noqa: E731
    for seed in range(4):
        drafter = fitted_drafter(target, answers, seed)
        for prompt, answer in answers:
            ids = prompt + answer
            rounded, _ = states.find(prompt, answer)
            exact = target_features(target, LAYERS, ids)
            seq = torch.tensor(ids)
            for p in range(len(prompt) - 1, len(ids) - 2):
                a = draft_chain(drafter, rounded, seq, p, 3)
                b = draft_chain(drafter, exact, seq, p, 3)
                flips += sum(x != y for x, y in zip(a, b))
                drafted += 3
        approx = replay_sequences(drafter, answers, [1, 3, 5], Features(LAYERS, states, None))
        forward = replay_sequences(drafter, answers, [1, 3, 5],
                                   Features(LAYERS, None, lambda: target))
        al_change = max([al_change] + [abs(al(approx, k) / al(forward, k) - 1)
                                       for k in (1, 3, 5)])
        # preferring the forward: every answer from it, none from the rounded states
        preferred = replay_sequences(drafter, answers, [1, 3, 5], Features(
            LAYERS, states, lambda: target, prefer_forward=True))
        assert preferred["sources"]["forward"] == 8 and preferred["counts"] == forward["counts"]
    print(f"{dtype}: {flips}/{drafted} draft tokens changed, acceptance length by at most "
          f"{al_change:.1%}")
    assert flips / drafted <= max_flips
    assert flips or dtype != "fp8"  # rounded inputs do move the drafts, a little
    assert al_change <= max_al_change


class _Progress:
    def enter_phase(self, phase):
        pass

    def advance(self, done=0, tokens=0):
        pass


def _counts_delta(counts: dict) -> dict:
    """vLLM's counter deltas that say what the replay ``counts`` say."""
    return {key: float(counts[key]) for key in ("drafts", "draft_tokens", "accepted")} | {
        "per_position": [float(c) for c in counts["per_position"]]}


def test_the_stage_replays_held_out_answers_from_stored_states_and_others_from_a_forward(
        world, tmp_path, monkeypatch):
    """evaluate's offline check: the held-out answers from the shard, the everyday ones from
    the target's forward where it loads, not at all where it does not (the comparison with
    vLLM then over the held-out requests alone); acceptance.json says which."""
    from eaglet import evaluate, export
    from eaglet.config import validate
    from eaglet.offline_eval import Features, replay_sequences

    target, stored, answers, drafter = world
    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)
    write_held_out(tmp_path / "shard.safetensors", target, stored, "float32")
    monkeypatch.setattr(export, "load_drafter", lambda *args, **kw: drafter)
    everyday = greedy(target, prompts_of(3, seed=7), 12)
    sets = {"heldout": answers[:5], "everyday": everyday}
    forward = {name: replay_sequences(drafter, seqs, [3], Features(LAYERS, None, lambda: target))
               for name, seqs in sets.items()}

    def level(name, seqs, delta):
        return {"set": name, "concurrency": 1, "_delta": delta,
                "_answers": [{"id": f"{name}{i}", "prompt_token_ids": p, "token_ids": a}
                             for i, (p, a) in enumerate(seqs)]}
    empty = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_position": []}
    runs = [{"name": "baseline", "method": "baseline",
             "levels": [level(n, s, empty) for n, s in sets.items()]},
            {"name": "eagle3_k3", "method": "eagle3", "k": 3,
             "levels": [level(n, s, _counts_delta(forward[n]["counts"][3]))
                        for n, s in sets.items()]}]
    cfg = validate({"target": {"dtype": "float32"}})
    check = lambda: evaluate.offline_check(cfg, str(target_dir), "drafter", runs,  # noqa: E731
                                           _Progress(), [str(tmp_path / "shard.safetensors")])

    out, replayed = check()
    assert replayed["sets"]["heldout"]["states"] == "stored states"
    assert replayed["sets"]["everyday"]["states"] == "forward"
    assert replayed["sets"]["everyday"]["not_stored"] == 3 and replayed["forward"] == "loaded"
    run = out["eagle3_k3"]
    assert run["ratio_offline_over_vllm"] == 1.0 and run["every_request_replayed"]
    assert run["sets_compared"] == ["heldout", "everyday"]
    assert {s["ratio_offline_over_vllm"] for s in run["sets"].values()} == {1.0}

    # a target too large for this machine: the held-out answers alone, compared alone
    monkeypatch.setattr(evaluate, "host_memory_bytes", lambda: 1 << 10)
    out, replayed = check()
    assert replayed["sets"]["everyday"] | {"states": "not replayed", "left_out": 3} == \
        replayed["sets"]["everyday"]
    assert replayed["sets"]["heldout"]["stored"] == 5
    assert "more than 80% of the machine's" in replayed["forward"]
    run = out["eagle3_k3"]
    assert run["sets_compared"] == ["heldout"] and run["ratio_offline_over_vllm"] == 1.0
    assert run["vllm_acceptance_length"] == pytest.approx(
        1 + forward["heldout"]["counts"][3]["accepted"] / forward["heldout"]["counts"][3]["drafts"])
    monkeypatch.undo()
    monkeypatch.setattr(export, "load_drafter", lambda *args, **kw: drafter)

    # bfloat16 stored beside a float32 server: a target that loads is run instead
    write_held_out(tmp_path / "shard.safetensors", target, stored, "bfloat16")
    out, replayed = check()
    assert replayed["stored_dtype"] == "bfloat16" and replayed["served_dtype"] == "float32"
    assert replayed["sets"]["heldout"]["states"] == "forward"
    assert out["eagle3_k3"]["ratio_offline_over_vllm"] == 1.0
