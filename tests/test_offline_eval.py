"""The offline acceptance replay: against an oracle drafter, against a plain reference of the
chain on the drafter's own TTT forward, and end to end on a tiny target."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eaglet.model.attention import attention_blocks
from eaglet.model.config import DrafterConfig
from eaglet.model.drafter import Eagle3Drafter
from eaglet.model.replay import draft_chain, offline_acceptance, replay, target_features

V, H = 96, 32


def tiny_drafter(seed: int = 0, aux_layer_ids=(0, 1, 2)) -> Eagle3Drafter:
    torch.manual_seed(seed)
    config = DrafterConfig(
        hidden_size=H,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        max_position_embeddings=256,
        vocab_size=V,
        draft_vocab_size=48,
        target_hidden_size=H,
        aux_layer_ids=list(aux_layer_ids),
    )
    draft_ids = torch.arange(0, V, 2)  # every other target id
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
    oracle = lambda p, n: ids[p + 2 : p + 2 + n]  # noqa: E731  (the target's own greedy tokens)
    counts = replay(oracle, ids, prompt_len, k)
    assert counts["drafts"] == 8 and counts["accepted"] == 8 * k
    assert counts["per_position"] == [8, 8, 8]
    assert 1 + counts["accepted"] / counts["drafts"] == k + 1


def test_a_drafter_that_is_always_wrong_gets_nothing_accepted():
    ids = list(range(30))
    counts = replay(lambda p, n: [-1] * n, ids, 4, 3)
    assert counts["accepted"] == 0 and counts["drafts"] == len(ids) - 4 - 1


def test_drafts_the_server_drops_are_no_drafting_steps_and_cut_ones_count_what_is_left():
    """Where the server holds answers to a grammar it keeps of each draft the prefix the
    grammar accepts (eaglet.engine.grammar): a round whose draft it drops to nothing is no
    drafting step (the target produces one token), a cut one counts its kept tokens."""
    from eaglet.model.replay import kept

    ids = list(range(30))
    wrong = lambda p, n: [-1] * n  # noqa: E731
    # every third round's draft dropped, the others cut to 2 tokens
    keep = lambda p, drafts: [] if p % 3 == 0 else drafts[:2]  # noqa: E731
    counts = replay(kept(wrong, keep), ids, 4, 3)
    rows = range(3, len(ids) - 2)
    assert counts["drafts"] == sum(1 for p in rows if p % 3)
    assert counts["draft_tokens"] == 2 * counts["drafts"]
    oracle = lambda p, n: ids[p + 2 : p + 2 + n]  # noqa: E731
    assert replay(kept(oracle, None), ids, 5, 3) == replay(oracle, ids, 5, 3)


def reference_chain(drafter: Eagle3Drafter, aux, ids, p: int, k: int) -> list[int]:
    """Plainly: run the drafter's full TTT forward over rows 0..p with 1, 2, ..., k steps,
    writing each new draft into the next step's input at row p."""
    rows = p + 1
    steps = [ids[1 : rows + 1].clone()]
    drafts = []
    for _ in range(k):
        logits = drafter(
            aux[:rows], torch.stack(steps), torch.arange(rows), torch.zeros(rows, dtype=torch.long)
        )
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
    target = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=H,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=V,
            max_position_embeddings=256,
        )
    ).eval()
    drafter = tiny_drafter()
    prompts = [[1, 5, 7, 9], [3, 4]]
    sequences = []
    for prompt in prompts:
        out = target.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=12, pad_token_id=0
        )
        sequences.append((prompt, out[0, len(prompt) :].tolist()))
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
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=H,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=V,
            max_position_embeddings=256,
        )
    ).eval()


@torch.inference_mode()
def greedy(target, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[list, list]]:
    return [
        (
            p,
            target.generate(
                torch.tensor([p]), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0
            )[0, len(p) :].tolist(),
        )
        for p in prompts
    ]


def prompts_of(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, V, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def write_held_out(
    path, target, samples: list[tuple[list, list]], dtype: str, final: bool = False
) -> None:
    """A held-out shard as extraction writes it: each sample's prompt + answer with the
    target's aux states of every row (the final states too with ``final``, else zeros; the
    teacher is not read here)."""
    from eaglet.data import shards

    ids, mask, offsets, aux, last = [], [], [0], [], []
    for prompt, answer in samples:
        ids += prompt + answer
        mask += [0] * len(prompt) + [1] * len(answer)
        offsets.append(len(ids))
        states, normed = target_features(target, LAYERS, prompt + answer, final=True)
        aux.append(states)
        last.append(normed if final else torch.zeros_like(normed))
    n = len(ids)
    shards.write(
        path,
        torch.tensor(ids),
        torch.tensor(mask),
        torch.tensor(offsets),
        torch.full((n,), -1),
        torch.cat(aux),
        torch.cat(last),
        sample_ids=[f"s{i}" for i in range(len(samples))],
        aux_layer_ids=LAYERS,
        dtype=dtype,
        target={},
    )


def fitted_drafter(
    target, samples: list[tuple[list, list]], seed: int = 0, steps: int = 15
) -> Eagle3Drafter:
    """A full-vocabulary drafter whose lm_head is fitted for a few steps to predict each
    row's token after next from its first step's hidden state: it drafts the first token
    right about half the time on these samples, as a trained drafter does (a random one
    accepts nothing, so no replay could tell one source of states from another)."""
    torch.manual_seed(seed)
    config = DrafterConfig(
        hidden_size=H,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        max_position_embeddings=256,
        vocab_size=V,
        draft_vocab_size=V,
        target_hidden_size=H,
        aux_layer_ids=LAYERS,
    )
    drafter = Eagle3Drafter(
        config,
        target.model.embed_tokens.weight.detach().clone(),
        torch.zeros(V, dtype=torch.long),
        torch.ones(V, dtype=torch.bool),
    )
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
            hidden = drafter.midlayer(
                drafter.embed_tokens[torch.tensor(ids[1 : rows + 1])],
                drafter.fc(target_features(target, LAYERS, ids)[:rows]),
                cos,
                sin,
                blocks,
                [],
            )
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
    from eaglet.model.replay import Features, StoredStates, replay_sequences

    target, stored, answers, drafter = world
    write_held_out(tmp_path / "shard.safetensors", target, stored, "float32")
    states = StoredStates([tmp_path / "shard.safetensors"])
    ks = [1, 3, 5]
    from_stored = replay_sequences(drafter, answers, ks, Features(LAYERS, states, None))
    loads = []
    from_forward = replay_sequences(
        drafter, answers, ks, Features(LAYERS, None, lambda: loads.append(1) or target)
    )
    assert from_stored["sources"] == {"sequences": 8, "stored": 8, "forward": 0, "left_out": 0}
    assert from_forward["sources"]["forward"] == 8 and loads == [1]  # loaded once, on need
    assert from_stored["counts"] == from_forward["counts"]
    assert all(from_stored["counts"][k]["accepted"] > 0 for k in ks)  # it drafts, and is heard
    # the rows up to the answer's length are the forward's states of the shorter sequence
    prompt, answer = answers[0]
    aux, how = states.find(prompt, answer)
    assert how == "stored" and aux.shape == (len(prompt) + len(answer), 3 * H)
    torch.testing.assert_close(
        aux, target_features(target, LAYERS, prompt + answer), rtol=1e-5, atol=1e-6
    )


def test_replays_of_one_evaluation_load_the_target_once_and_forward_each_answer_once(world):
    """The greedy checks of several drafters replay the same baseline answers: with one
    TargetForwards shared, the target loads once and each answer's forward runs once, with
    the counts of replays that each ran their own; the sampled replays (final-norm states)
    share the load and run their forwards again."""
    from eaglet.model.replay import Features, TargetForwards, replay_sequences

    target, _, answers, drafter = world
    loads = []
    shared = TargetForwards(lambda: loads.append(1) or target)
    first = replay_sequences(
        drafter, answers, [3], Features(LAYERS, None, lambda: target, forwards=shared)
    )
    again = replay_sequences(
        drafter, answers, [1, 3], Features(LAYERS, None, lambda: target, forwards=shared)
    )
    assert loads == [1] and shared.forwards == len(answers)
    alone = replay_sequences(drafter, answers, [1, 3], Features(LAYERS, None, lambda: target))
    assert first["counts"][3] == again["counts"][3] == alone["counts"][3]
    assert again["counts"] == alone["counts"] and again["sources"]["forward"] == len(answers)
    sampled = Features(LAYERS, None, lambda: target, final=True, forwards=shared)
    assert sampled.forward(answers[0][0] + answers[0][1]) is not None
    assert loads == [1] and shared.forwards == len(answers) + 1


def test_an_answer_whose_tokens_differ_is_left_out_and_counted(world, tmp_path):
    from eaglet.model.replay import Features, StoredStates, replay_sequences

    target, stored, answers, drafter = world
    write_held_out(tmp_path / "shard.safetensors", target, stored, "float32")
    states = StoredStates([tmp_path / "shard.safetensors"])
    (p0, a0), (p1, _), (_, a2) = answers[:3]
    changed = [
        (p0, a0[:5] + [(a0[5] + 1) % V] + a0[6:]),  # sampled: another token at 5
        (p1, stored[1][1] + [7, 8]),  # longer than the stored answer
        ([95, 94, 93], a2),
    ]  # a prompt no shard stores
    mixed = answers[3:] + changed
    alone = replay_sequences(
        drafter, mixed, [3], Features(LAYERS, states, None, no_forward="too large")
    )
    assert alone["sources"] == {
        "sequences": 8,
        "stored": 5,
        "forward": 0,
        "left_out": 3,
        "differs": 1,
        "longer_than_stored": 1,
        "not_stored": 1,
    }
    # the left-out answers add nothing: the counts are those of the stored ones alone
    assert (
        alone["counts"]
        == replay_sequences(drafter, answers[3:], [3], Features(LAYERS, states, None))["counts"]
    )
    # with a target that loads, they are replayed from its forward instead (still counted)
    both = replay_sequences(drafter, mixed, [3], Features(LAYERS, states, lambda: target))
    assert both["sources"] == {
        "sequences": 8,
        "stored": 5,
        "forward": 3,
        "left_out": 0,
        "differs": 1,
        "longer_than_stored": 1,
        "not_stored": 1,
    }
    assert (
        both["counts"]
        == replay_sequences(drafter, mixed, [3], Features(LAYERS, None, lambda: target))["counts"]
    )


def test_a_target_that_fails_to_load_leaves_the_stored_states_to_replay(world, tmp_path):
    from eaglet.model.replay import Features, StoredStates, replay_sequences

    target, stored, answers, drafter = world
    write_held_out(tmp_path / "shard.safetensors", target, stored, "float32")

    def no_mapping():
        raise ValueError("Unrecognized configuration class KimiK25Config")

    features = Features(LAYERS, StoredStates([tmp_path / "shard.safetensors"]), no_mapping)
    got = replay_sequences(drafter, answers[:2] + [([95, 94, 93], [1, 2, 3])], [3], features)
    assert got["sources"]["stored"] == 2 and got["sources"]["left_out"] == 1
    assert "KimiK25Config" in features.no_forward and not features.loaded


@pytest.mark.subprocess  # heavy in-process: 20 s
@pytest.mark.parametrize(
    "dtype, max_flips, max_al_change", [("bfloat16", 0.02, 0.03), ("fp8", 0.06, 0.05)]
)
def test_states_stored_coarser_than_served_move_the_replay_a_little(
    world, tmp_path, dtype, max_flips, max_al_change
):
    """How far a replay from rounded stored states is from one from a float32 forward (what
    a float32 server's drafter reads), on the tiny world with 4 fitted drafters, drafting k 3
    at every row and replaying at k 1, 3 and 5. Measured: bfloat16 changed 0.2% of the draft
    tokens (3 of 1440) and the acceptance length by at most 1.4%; fp8 2.4% of the draft tokens
    (34) and the acceptance length by at most 3.7%; float32 storage changes nothing (above).
    So where the store is coarser than the server and the target can be loaded, evaluate runs
    the target instead; where it cannot (a 1T target), the replay reads the stored states and
    acceptance.json says so."""
    from eaglet.model.replay import Features, StoredStates, coarser, draft_chain, replay_sequences

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
        forward = replay_sequences(
            drafter, answers, [1, 3, 5], Features(LAYERS, None, lambda: target)
        )
        al_change = max([al_change] + [abs(al(approx, k) / al(forward, k) - 1) for k in (1, 3, 5)])
        # preferring the forward: every answer from it, none from the rounded states
        preferred = replay_sequences(
            drafter,
            answers,
            [1, 3, 5],
            Features(LAYERS, states, lambda: target, prefer_forward=True),
        )
        assert preferred["sources"]["forward"] == 8 and preferred["counts"] == forward["counts"]
    print(
        f"{dtype}: {flips}/{drafted} draft tokens changed, acceptance length by at most "
        f"{al_change:.1%}"
    )
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
        "per_position": [float(c) for c in counts["per_position"]]
    }


def test_the_stage_replays_held_out_answers_from_stored_states_and_others_from_a_forward(
    world, tmp_path, monkeypatch
):
    """evaluate's offline check: the held-out answers from the shard, the everyday ones from
    the target's forward where it loads, not at all where it does not (the comparison with
    vLLM then over the held-out requests alone); acceptance.json says which."""
    from eaglet.core.config import validate
    from eaglet.model import export
    from eaglet.model.replay import Features, replay_sequences
    from eaglet.stages.evaluate import offline as evaluate

    target, stored, answers, drafter = world
    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)
    write_held_out(tmp_path / "shard.safetensors", target, stored, "float32")
    monkeypatch.setattr(export, "load_drafter", lambda *args, **kw: drafter)
    everyday = greedy(target, prompts_of(3, seed=7), 12)
    sets = {"heldout": answers[:5], "everyday": everyday}
    forward = {
        name: replay_sequences(drafter, seqs, [3], Features(LAYERS, None, lambda: target))
        for name, seqs in sets.items()
    }

    def level(name, seqs, delta):
        return {
            "set": name,
            "concurrency": 1,
            "_delta": delta,
            "_answers": [
                {"id": f"{name}{i}", "prompt_token_ids": p, "token_ids": a}
                for i, (p, a) in enumerate(seqs)
            ],
        }

    empty = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_position": []}
    runs = [
        {
            "name": "baseline",
            "method": "baseline",
            "levels": [level(n, s, empty) for n, s in sets.items()],
        },
        {
            "name": "eagle3_k3",
            "method": "eagle3",
            "k": 3,
            "levels": [
                level(n, s, _counts_delta(forward[n]["counts"][3])) for n, s in sets.items()
            ],
        },
    ]
    cfg = validate({"target": {"dtype": "float32"}})
    check = lambda: evaluate.offline_check(
        cfg,
        str(target_dir),
        "drafter",
        runs,  # noqa: E731
        _Progress(),
        [str(tmp_path / "shard.safetensors")],
    )

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
    assert (
        replayed["sets"]["everyday"] | {"states": "not replayed", "left_out": 3}
        == replayed["sets"]["everyday"]
    )
    assert replayed["sets"]["heldout"]["stored"] == 5
    assert "more than 80% of the machine's" in replayed["forward"]
    run = out["eagle3_k3"]
    assert run["sets_compared"] == ["heldout"] and run["ratio_offline_over_vllm"] == 1.0
    assert run["vllm_acceptance_length"] == pytest.approx(
        1 + forward["heldout"]["counts"][3]["accepted"] / forward["heldout"]["counts"][3]["drafts"]
    )
    monkeypatch.undo()
    monkeypatch.setattr(export, "load_drafter", lambda *args, **kw: drafter)

    # bfloat16 stored beside a float32 server: a target that loads is run instead
    write_held_out(tmp_path / "shard.safetensors", target, stored, "bfloat16")
    out, replayed = check()
    assert replayed["stored_dtype"] == "bfloat16" and replayed["served_dtype"] == "float32"
    assert replayed["sets"]["heldout"]["states"] == "forward"
    assert out["eagle3_k3"]["ratio_offline_over_vllm"] == 1.0


# -- at a temperature: the expected acceptance against vLLM's rejection sampling -------------
#
# A toy target whose next-token distribution depends on the last token only (a bigram table of
# logits, TOY_V tokens) and a toy drafter that chains greedily on its own noisy copy of the
# table, as EAGLE drafts on its own proposals. Rows of a sequence map as in the replay: the
# target's distribution right after row r is the table's row of token r.

TOY_V = 5


def toy(seed: int = 0, noise: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    target = 2.0 * torch.randn(TOY_V, TOY_V, generator=g)
    drafter = target + noise * torch.randn(TOY_V, TOY_V, generator=g)
    return target, drafter


def toy_probs(target: torch.Tensor, temperature: float) -> list[list[float]]:
    """p(next | last) at ``temperature``, as vLLM's sampler computes it (token_probability)."""
    from eaglet.model.replay import token_probability

    return [
        [token_probability(target[a], b, temperature) for b in range(TOY_V)] for a in range(TOY_V)
    ]


def toy_chain(drafter: torch.Tensor, last: int, k: int) -> list[int]:
    out = []
    for _ in range(k):
        last = int(drafter[last].argmax())
        out.append(last)
    return out


def chain_expectation(p: list[list[float]], last: int, drafts: list[int]) -> list[float]:
    """The closed form: P(drafts 1..i all accepted) = prod_{j<=i} p(x_j | x_{j-1}) for each
    i, the target's probabilities given the drafts themselves as context."""
    out, reach = [], 1.0
    for x in drafts:
        reach *= p[last][x]
        out.append(reach)
        last = x
    return out


def simulate_vllm(
    p: list[list[float]], drafter: torch.Tensor, first: int, k: int, n: int, rng
) -> tuple[list[int], list[tuple[int, int]]]:
    """vLLM 0.32's verification of greedy drafts at a temperature (rejection_sampler.py with
    no draft probabilities): draft x is accepted where a uniform u <= p(x); a rejection
    emits a recovered token sampled from p with x taken out; all k accepted, a bonus token
    from p after the last. Returns the answer (``first`` then ``n`` more tokens) and each
    drafting round's (start, accepted), its start the index of the answer's last token."""

    def sample(weights):
        return rng.choices(range(TOY_V), weights=weights)[0]

    tokens, rounds = [first], []
    while len(tokens) < n + 1:
        start, accepted = len(tokens) - 1, 0
        for x in toy_chain(drafter, tokens[-1], k):
            dist = p[tokens[-1]]
            if rng.random() <= dist[x]:
                tokens.append(x)
                accepted += 1
                continue
            tokens.append(sample([0.0 if t == x else w for t, w in enumerate(dist)]))
            break
        else:
            tokens.append(sample(p[tokens[-1]]))
        rounds.append((start, accepted))
    return tokens[: n + 1], rounds


def toy_replay(
    p, drafter, ids: list[int], k: int, first_round_only: bool = False, top=None
) -> dict:
    """The replay of one toy answer (prompt = its first token) with the toy's drafts and
    probabilities; ``first_round_only``: later rounds draft nothing anyone accepts; ``top``:
    the table whose argmax is the target's most likely next token (the top-token reference)."""
    from eaglet.model.replay import expected_replay

    def draft(row, n):
        return toy_chain(drafter, ids[row + 1], n) if row == 0 or not first_round_only else [-1] * n

    return expected_replay(
        draft,
        lambda row, x: p[ids[row]][x] if x >= 0 else 0.0,
        ids,
        1,
        k,
        None if top is None else lambda row: int(top[ids[row]].argmax()),
    )


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_the_expected_acceptance_of_a_round_is_the_closed_form_over_every_answer(temperature):
    """Over every answer the target can give after a context (weighted by its probability),
    the replay's expected acceptance of the first round is the closed form: the chain's
    probability position by position, the target's distribution given the drafts."""
    import itertools

    target, drafter = toy(seed=3)
    p = toy_probs(target, temperature)
    k, first = 3, 2
    drafts = toy_chain(drafter, first, k)
    closed = chain_expectation(p, first, drafts)
    accepted, per_position = 0.0, [0.0] * k
    for answer in itertools.product(range(TOY_V), repeat=k):
        weight = math.prod(p[a][b] for a, b in zip((first,) + answer, answer))
        counts = toy_replay(p, drafter, [0, first, *answer], k, first_round_only=True)
        accepted += weight * counts["accepted"]
        per_position = [s + weight * c for s, c in zip(per_position, counts["per_position"])]
    # exact but for the float32 softmax's rounding (its probabilities sum to 1 within 1e-7)
    assert per_position == pytest.approx(closed, rel=1e-6)
    assert accepted == pytest.approx(sum(closed), rel=1e-6)
    assert 0.05 < closed[0] < 0.95  # neither certain nor hopeless: the test can tell


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_the_expected_acceptance_is_vllms_rejection_sampling_on_average(temperature):
    """vLLM's rejection sampling simulated over many answers with a seeded generator: its
    acceptance is the closed form's from each round's start; the replay's matches on its
    answers are its counts exactly; and the replay's expected acceptance, on its answers or
    on answers sampled from the target with no drafter at all, is its acceptance length.
    Random quantities agree within four standard errors."""
    import random

    target, drafter = toy(seed=1)
    p = toy_probs(target, temperature)
    k, n, trials = 3, 24, 2000
    rng = random.Random(0)
    closed_gap, on_vllm, on_target = [], [], []
    for _ in range(trials):
        first = rng.randrange(TOY_V)
        tokens, rounds = simulate_vllm(p, drafter, first, k, n, rng)
        # brute force against the closed form, round by round
        closed_gap += [
            accepted - sum(chain_expectation(p, tokens[s], toy_chain(drafter, tokens[s], k)))
            for s, accepted in rounds
        ]
        counts = toy_replay(p, drafter, [0, *tokens], k)
        # a greedy draft is accepted exactly where the answer took it: vLLM's own counts
        # (the last round's cut where the answer ends)
        assert counts["drafts"] == len(rounds)
        assert counts["matched"] == sum(min(a, n - s) for s, a in rounds)
        on_vllm.append(counts)
        answer = [first]  # the target's own answer, sampled token by token
        while len(answer) < n + 1:
            answer.append(rng.choices(range(TOY_V), weights=p[answer[-1]])[0])
        on_target.append(toy_replay(p, drafter, [0, *answer], k))

    def within(gaps):  # a mean of differences with mean 0, within four standard errors
        error = statistics.stdev(gaps) / math.sqrt(len(gaps))
        assert abs(statistics.mean(gaps)) < 4 * error, (statistics.mean(gaps), error)

    within(closed_gap)
    vllm_al = 1 + sum(c["matched"] for c in on_vllm) / sum(c["drafts"] for c in on_vllm)
    # on vLLM's answers: each answer's expected against its counted acceptances
    gaps = [c["accepted"] - c["matched"] for c in on_vllm]
    within(gaps)
    # and the replay's variance is that gap's: the spread chance alone gives the count
    # (the sample variance of 2000 answers is within about 3% of the true one)
    predicted = statistics.mean(c["variance"] for c in on_vllm)
    assert statistics.variance(gaps) == pytest.approx(predicted, rel=0.15)
    assert predicted > 0.5  # several rounds of uncertain acceptances: the test can tell
    from eaglet.model.replay import add_counts, empty_counts, summarize

    total = empty_counts(k)
    for c in on_vllm:
        add_counts(total, c)
    pooled = summarize(total, k)
    assert pooled["standard_error"] == pytest.approx(
        math.sqrt(predicted * trials) / total["drafts"]
    )
    # on the target's own answers: the acceptance length against vLLM's, each answer's
    # deviation from it per drafting round (the ratio's first-order error), both samples
    deviations = [c["accepted"] - (vllm_al - 1) * c["drafts"] for c in on_target] + [
        -(c["matched"] - (vllm_al - 1) * c["drafts"]) for c in on_vllm
    ]
    within(deviations)
    expected_al = 1 + sum(c["accepted"] for c in on_target) / sum(c["drafts"] for c in on_target)
    assert expected_al == pytest.approx(vllm_al, rel=0.03)  # evaluate's tolerance, here too
    assert 1.3 < vllm_al < k  # drafts are accepted, but not all: the test can tell


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_the_top_token_reference_is_what_vllm_counts_for_drafts_of_the_targets_top_token(
    temperature,
):
    """The replay's top-token reference, read off answers vLLM sampled with another
    drafter (speculative sampling leaves them the target's), is the acceptance vLLM counts
    for a drafter whose drafts are the target's own most likely tokens (simulated, seeded),
    within four standard errors; and the toy drafter, which guesses worse, falls below it."""
    import random

    target, drafter = toy(seed=1)
    p = toy_probs(target, temperature)
    k, n, trials = 3, 24, 2000
    rng = random.Random(2)
    read, counted = [], []
    for _ in range(trials):
        tokens, _ = simulate_vllm(p, drafter, rng.randrange(TOY_V), k, n, rng)
        read.append(toy_replay(p, drafter, [0, *tokens], k, top=target))
        _, rounds = simulate_vllm(p, target, rng.randrange(TOY_V), k, n, rng)
        counted.append((sum(min(a, n - s) for s, a in rounds), len(rounds)))
    top_al = 1 + sum(a for a, _ in counted) / sum(r for _, r in counted)
    deviations = [c["top_token"] - (top_al - 1) * c["top_token_drafts"] for c in read] + [
        -(a - (top_al - 1) * r) for a, r in counted
    ]
    error = statistics.stdev(deviations) / math.sqrt(len(deviations))
    assert abs(statistics.mean(deviations)) < 4 * error, (statistics.mean(deviations), error)
    from eaglet.model.replay import add_counts, empty_counts, summarize

    total = empty_counts(k)
    for c in read:
        add_counts(total, c)
    pooled = summarize(total, k)
    assert pooled["top_token_acceptance_length"] == pytest.approx(top_al, rel=0.03)
    assert pooled["acceptance_length"] < pooled["top_token_acceptance_length"] - 0.1
    assert 1.3 < top_al < k + 0.5  # the top token is rejected often: the test can tell


# -- the expected acceptance on a tiny target ------------------------------------------------


@torch.inference_mode()
def sampled(
    target, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int = 0
) -> list[tuple[list, list]]:
    torch.manual_seed(seed)
    return [
        (
            p,
            target.generate(
                torch.tensor([p]),
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                pad_token_id=0,
            )[0, len(p) :].tolist(),
        )
        for p in prompts
    ]


def test_the_final_states_give_the_targets_own_next_token_distribution(world):
    from eaglet.model.replay import token_probability

    target, _, answers, _ = world
    prompt, answer = answers[0]
    ids = prompt + answer
    aux, final = target_features(target, LAYERS, ids, final=True)
    torch.testing.assert_close(aux, target_features(target, LAYERS, ids))
    with torch.no_grad():
        logits = target(torch.tensor([ids])).logits[0]
    head = target.get_output_embeddings().weight.detach()
    torch.testing.assert_close(final @ head.T, logits, rtol=1e-5, atol=1e-5)
    row, token = len(prompt), answer[1]
    assert token_probability(final[row] @ head.T, token, 0.7) == pytest.approx(
        float(torch.softmax(logits[row] / 0.7, -1)[token]), rel=1e-5
    )
    assert token_probability(logits[row], int(logits[row].argmax()), 0) == 1.0
    assert token_probability(logits[row], int(logits[row].argmin()), 0) == 0.0


def test_the_expected_replay_at_temperature_0_is_the_greedy_replay(world):
    from eaglet.model.replay import expected_counts, replay_counts

    target, _, answers, drafter = world
    head = target.get_output_embeddings().weight.detach()
    for prompt, answer in answers:
        states = target_features(target, LAYERS, prompt + answer, final=True)
        for k in (1, 3):
            greedy_counts = replay_counts(drafter, states[0], prompt, answer, k)
            expected = expected_counts(drafter, states, head, prompt, answer, k, 0.0)
            assert expected["accepted"] == expected["matched"] == greedy_counts["accepted"]
            assert expected["per_position"] == greedy_counts["per_position"]
            assert expected["drafts"] == greedy_counts["drafts"]


def test_sampled_answers_replay_alike_from_stored_final_states_and_from_a_forward(world, tmp_path):
    from eaglet.model.replay import Features, StoredStates, replay_sequences

    target, _, _, drafter = world
    answers = sampled(target, prompts_of(6, seed=5), 16, temperature=0.5)
    write_held_out(tmp_path / "shard.safetensors", target, answers, "float32", final=True)
    head = target.get_output_embeddings().weight.detach()
    stored = replay_sequences(
        drafter,
        answers,
        [3],
        Features(LAYERS, StoredStates([tmp_path / "shard.safetensors"]), None, final=True),
        0.5,
        head,
    )
    forward = replay_sequences(
        drafter, answers, [3], Features(LAYERS, None, lambda: target, final=True), 0.5, head
    )
    assert stored["sources"]["stored"] == 6 and forward["sources"]["forward"] == 6
    mine, theirs = stored["counts"][3], forward["counts"][3]
    assert mine["drafts"] == theirs["drafts"] and mine["matched"] == theirs["matched"]
    assert mine["accepted"] == pytest.approx(theirs["accepted"], rel=1e-4)
    assert 0 < mine["accepted"] < mine["draft_tokens"]
    with pytest.raises(ValueError, match="needs the target's lm_head"):
        replay_sequences(drafter, answers, [3], Features(LAYERS, None, lambda: target), 0.5)


@pytest.mark.subprocess  # heavy in-process: 9 s
def test_the_stage_compares_sampled_runs_by_their_expected_acceptance(world, tmp_path, monkeypatch):
    """evaluate's check at a temperature: each run's own sampled answers replayed for their
    expected acceptance beside vLLM's counters. Here vLLM's counters are what vLLM counts
    with greedy drafts (the drafts its answers took), so the replay's matches equal them."""
    from eaglet.core.config import validate
    from eaglet.model import export
    from eaglet.model.replay import replay_counts
    from eaglet.stages.evaluate import offline as evaluate

    target, _, _, drafter = world
    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)
    monkeypatch.setattr(export, "load_drafter", lambda *args, **kw: drafter)
    answers = sampled(target, prompts_of(6, seed=9), 16, temperature=0.5)
    own = [
        replay_counts(drafter, target_features(target, LAYERS, p + a), p, a, 3) for p, a in answers
    ]
    delta = {
        key: float(sum(c[key] for c in own)) for key in ("drafts", "draft_tokens", "accepted")
    } | {"per_position": [float(sum(c["per_position"][j] for c in own)) for j in range(3)]}
    run = {
        "name": "eagle3_k3_T0.5",
        "method": "eagle3",
        "k": 3,
        "temperature": 0.5,
        "levels": [
            {
                "set": "heldout",
                "concurrency": 1,
                "_delta": delta,
                "_answers": [
                    {
                        "id": f"p{i}",
                        "prompt_token_ids": p,
                        "token_ids": a,
                        "spec_decoding": {
                            key: c[key] for key in ("drafts", "draft_tokens", "accepted")
                        },
                    }
                    for i, ((p, a), c) in enumerate(zip(answers, own))
                ],
            }
        ],
    }
    cfg = validate({"target": {"dtype": "float32"}})
    out = evaluate.expected_check(
        cfg,
        str(target_dir),
        "drafter",
        [{"name": "baseline_T0.5", "method": "baseline"}, run],
        _Progress(),
    )
    entry = out["eagle3_k3_T0.5"]
    vllm_al = 1 + delta["accepted"] / delta["drafts"]
    assert entry["vllm_acceptance_length"] == pytest.approx(vllm_al)
    assert entry["matched_acceptance_length"] == pytest.approx(vllm_al)
    assert entry["temperature"] == 0.5 and entry["tolerance"] == evaluate.EXPECTED_TOLERANCE
    assert entry["agrees"] == (abs(entry["ratio_offline_over_vllm"] - 1) <= 0.03)
    assert entry["states"]["heldout"]["states"] == "forward"
    assert entry["acceptance_length"] != entry["matched_acceptance_length"]  # an expectation
    # the same answers read for drafts of the target's top token, and the verdict's sentence
    assert 1 < entry["top_token_acceptance_length"] <= 4 and entry["standard_error"] > 0
    assert (
        f"would reach AL {entry['top_token_acceptance_length']:.2f} at k 3 and temperature "
        f"0.5 (this drafter {entry['acceptance_length']:.2f} expected)"
        in evaluate.top_token_note(entry)
    )
    # a drafter served beside the run's own for comparison is checked alike, by its own
    # directory, and the run's own drafter's check leaves it alone
    compared = {**run, "compare": True, "drafter": "other"}
    runs = [{"name": "baseline_T0.5", "method": "baseline"}, compared]
    assert (
        evaluate.expected_check(cfg, str(target_dir), "other", runs, _Progress(), compared=True)
        == out
    )
    assert evaluate.expected_check(cfg, str(target_dir), "drafter", runs, _Progress()) == {}
