"""P-EAGLE (parallel drafting): the export vLLM reads, the forward against vLLM's own one
forward over the query its proposer builds, the training objective, and the offline replay.

The vLLM side runs in a subprocess (``python -m tests.test_peagle``: vLLM's process-wide
state stays out of the test process): vLLM's config reader and ``Eagle3LlamaForCausalLM`` with
``parallel_drafting`` on load the export; the query is laid out by the CPU kernel of vLLM's
``copy_and_expand_eagle_inputs`` (input ids, positions, masked slots, hidden-state mapping);
the masked slots get ``combine_hidden_states(mask_hidden)`` as ``llm_base_proposer`` sets
them; vLLM's forward and ``compute_logits`` give the k drafts' logits. Only the attention
kernel, which needs the engine's KV cache and metadata, is a plain causal softmax here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglet.core import methods as records
from eaglet.model import methods, peagle
from eaglet.model.attention import attention_blocks
from eaglet.model.config import DrafterConfig
from eaglet.model.drafter import Eagle3Drafter
from eaglet.model.replay import draft_chain, draft_parallel, offline_acceptance, target_features
from eaglet.stages.train.data import make_batch
from eaglet.stages.train.step import batch_sums
from tests.helpers.paths import REPO
from tests.test_train import FAST, read_log, run, world  # noqa: F401 (world: a fixture)

V, H, K = 96, 32, 4
DRAFT_IDS = torch.arange(0, V, 2)  # every other target id: d2t matters


def tiny_config(**flags) -> DrafterConfig:
    return replace(
        DrafterConfig(
            hidden_size=H,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
            max_position_embeddings=256,
            vocab_size=V,
            draft_vocab_size=len(DRAFT_IDS),
            target_hidden_size=H,
            aux_layer_ids=[0, 1, 2],
        ),
        **flags,
    )


def tiny_peagle(
    seed: int = 0, embed: torch.Tensor | None = None, mask_token_id: int = 1, **flags
) -> peagle.PEagleDrafter:
    torch.manual_seed(seed)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[DRAFT_IDS] = True
    model = peagle.PEagleDrafter(
        tiny_config(**flags),
        torch.randn(V, H) if embed is None else embed,
        DRAFT_IDS - torch.arange(len(DRAFT_IDS)),
        t2d,
        mask_token_id,
    )
    with torch.no_grad():
        for param in model.parameters():
            torch.nn.init.normal_(param, std=0.3)
    return model.eval()


# -- the forward: vLLM's query, with eaglet's own layer ---------------------------------------


def vllm_query(model: peagle.PEagleDrafter, aux: torch.Tensor, ids: torch.Tensor, p: int, k: int):
    """The drafter's query after the target verified rows 0..p and sampled token p+1, laid
    out as ``copy_and_expand_eagle_inputs`` lays it out (shifted ids, the bonus row, then k-1
    masked slots at positions p+1..): (input ids, positions, hidden states, sampled rows)."""
    tokens = torch.cat([ids[1 : p + 2], torch.full((k - 1,), model.mask_token_id)])
    positions = torch.arange(p + k)
    hidden = model.combine(aux[: p + 1])
    masked = model.combine(model.mask_hidden[None]).expand(k - 1, -1)
    return tokens, positions, torch.cat([hidden, masked]), torch.arange(p, p + k)


def one_causal_forward(model: Eagle3Drafter, tokens, positions, hidden, sampled):
    """The drafter's layer once over a query, plain causal attention (vLLM's one forward)."""
    blocks = attention_blocks(torch.zeros(len(tokens), dtype=torch.long))
    cos, sin = model.rope(positions)
    normed, _ = model.draft_step(model.embed_tokens[tokens], hidden, cos, sin, blocks, [], sampled)
    return model.lm_head(normed)  # [k, Vd]


@pytest.mark.parametrize(
    "flags", [{}, {"fc_norm": True, "norm_output": True}], ids=["eagle3", "eagle3.1"]
)
@torch.inference_mode()
def test_training_forward_is_vllms_one_forward_over_its_query(flags):
    """Every row of the packed TTT forward, at every step, is the logit vLLM's single forward
    gives the corresponding slot of the query it builds for that anchor."""
    model = tiny_peagle(**flags)
    torch.manual_seed(1)
    lengths = [13, 9]
    ids = [torch.randint(0, V, (n,)) for n in lengths]
    aux = [torch.randn(n, 3 * H) for n in lengths]
    segments = torch.repeat_interleave(torch.arange(2), torch.tensor(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])
    step_ids = torch.stack([torch.cat([torch.cat([s[1:], s[-1:]]) for s in ids])] * K)
    logits = model(torch.cat(aux), step_ids, positions, segments)
    starts = [0, lengths[0]]
    for s, n in enumerate(lengths):
        for p in (0, 3, n - 2):
            expected = one_causal_forward(model, *vllm_query(model, aux[s], ids[s], p, K))
            got = torch.stack([logits[j][starts[s] + p] for j in range(K)])
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_masked_steps_read_no_token_and_nothing_fed_back():
    """Steps >= 1 embed the mask token whatever the batch's step ids say, and a row's drafts
    do not depend on the rows after it (the future is not read)."""
    model = tiny_peagle()
    torch.manual_seed(2)
    n = 12
    aux, ids = torch.randn(n, 3 * H), torch.randint(0, V, (K, n))
    args = (torch.arange(n), torch.zeros(n, dtype=torch.long))
    base = model(aux, ids, *args)
    other = ids.clone()
    other[1:] = torch.randint(0, V, (K - 1, n))
    for a, b in zip(base, model(aux, other, *args)):
        torch.testing.assert_close(a, b)
    cut = model(aux[:7], ids[:, :7], torch.arange(7), torch.zeros(7, dtype=torch.long))
    for a, b in zip(base, cut):
        torch.testing.assert_close(a[:7], b, rtol=1e-5, atol=1e-6)
    # step 0 is EAGLE-3's: the chain drafter's first draft with the same weights
    assert draft_chain(model, aux, ids[0], 6, K)[0] == draft_parallel(model, aux, ids[0], 6, K)[0]


# -- training --------------------------------------------------------------------------------


def sample(length: int, seed: int, head: torch.Tensor) -> tuple:
    """(id, input_ids, loss_mask, teacher_argmax, aux, final) like ``Samples.get``, the
    argmax (a target id) that of the teacher ``final @ head.T`` (head: draft-vocabulary rows)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (length,), generator=gen)
    mask = (torch.arange(length) >= 2).to(torch.uint8)
    final = torch.randn(length, H, generator=gen)
    argmax = DRAFT_IDS[(final @ head.T).argmax(-1)]
    return (f"s{seed}", ids, mask, argmax, torch.randn(length, 3 * H, generator=gen), final)


def test_loss_falls_on_a_memorisable_batch_and_mask_hidden_learns():
    model = tiny_peagle(seed=3).train()
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.05)
    teacher_head = torch.randn(len(DRAFT_IDS), H) * 3
    batch = make_batch([sample(16, 0, teacher_head), sample(11, 1, teacher_head)], K, model.t2d)
    counts = batch.counts()
    weights = 0.8 ** torch.arange(K, dtype=torch.float32)
    start = model.mask_hidden.detach().clone()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(80):
        ce, agree = batch_sums(model, batch, teacher_head)
        loss = (weights * ce / counts.clamp(min=1)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert not torch.equal(model.mask_hidden.detach(), start)  # the masked slots' state trains
    # the later steps (masked slots only) learned too, not only step 0
    assert (agree[1:] / counts[1:]).min() > 0.5


def test_make_drafter_picks_the_method_and_the_targets_bos_as_mask():
    config = tiny_config()
    embed, d2t = torch.randn(V, H), torch.zeros(len(DRAFT_IDS), dtype=torch.long)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[: len(DRAFT_IDS)] = True
    target = {"vocab_size": V, "bos_token_id": 5, "eos_token_id": [7, 8], "pad_token_id": None}
    plain = methods.make_drafter("eagle3", target, config, embed, d2t, t2d)
    parallel = methods.make_drafter("peagle", target, config, embed, d2t, t2d)
    assert type(plain) is Eagle3Drafter and isinstance(parallel, peagle.PEagleDrafter)
    assert parallel.mask_token_id == 5
    assert peagle.mask_token_id({"vocab_size": V, "eos_token_id": [7, 8]}) == 7
    assert peagle.mask_token_id({"text_config": {"vocab_size": V, "bos_token_id": 9}}) == 9
    with pytest.raises(ValueError, match="none of"):
        methods.make_drafter("medusa", target, config, embed, d2t, t2d)
    with pytest.raises(ValueError, match="drafter_attention: llama"):
        methods.make_drafter(
            "peagle", target, replace(config, attention_kind="mla"), embed, d2t, t2d
        )


@pytest.mark.subprocess  # heavy in-process: 12 s
def test_train_method_peagle_trains_exports_and_never_resumes_as_eagle3(world, tmp_path):
    """``train.method: peagle`` through the training run: the losses fall, the export is the
    parallel drafter (mask token: the target's bos), and an EAGLE-3 run over its
    checkpoints starts over instead of resuming them."""
    run(world, tmp_path, {**FAST, "epochs": 4, "method": "peagle"})
    out = tmp_path / "run" / "drafter"
    evals = [r for r in read_log(out / "training_log.csv") if r["split"] == "eval"]
    assert float(evals[-1]["loss"]) < float(evals[0]["loss"])
    config = json.loads((out / "config.json").read_text())
    target = json.loads((Path(world["target"]) / "config.json").read_text())
    assert config["parallel_drafting"] is True
    assert config["mask_token_id"] == target["bos_token_id"]
    drafter = peagle.load_peagle(out, world["target"])
    assert isinstance(drafter, peagle.PEagleDrafter)
    trained = [r for r in read_log(out / "training_log.csv") if r["split"] == "train"]
    assert float(trained[-1]["loss"]) < 0.5 * float(trained[0]["loss"])
    assert float(trained[-1]["acc_2"]) > 0  # the last masked slot learned too
    again = run(world, tmp_path, FAST)  # eagle3, the default
    assert again["resumed_from_step"] == 0
    assert "mask_hidden" not in load_file(str(out / "model.safetensors"))


# -- the export, read and run by vLLM's own code ----------------------------------------------


def test_export_round_trips_and_is_a_plain_eagle3_checkpoint_plus_the_mask(tmp_path):
    from tests.tiny_llama import make_tiny_llama

    target = make_tiny_llama(tmp_path / "target")
    model = tiny_peagle(embed=target.model.embed_tokens.weight.detach()[:V], mask_token_id=3)
    config = methods.export(model, tmp_path / "drafter")
    written = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert written == config
    assert (written["mask_token_id"], written["parallel_drafting"]) == (3, True)
    weights = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    torch.testing.assert_close(weights["mask_hidden"], model.mask_hidden.detach())
    assert records.exported(tmp_path / "drafter") is records.PEAGLE
    assert (
        records.exported(tmp_path / "drafter").speculative_config(tmp_path / "drafter", 3)[
            "parallel_drafting"
        ]
        is True
    )
    # an EAGLE-3 drafter keeps its own checkpoint and serves without parallel drafting
    plain = Eagle3Drafter(model.config, model.embed_tokens, model.d2t, model.t2d)
    methods.export(plain, tmp_path / "plain")
    assert "mask_hidden" not in load_file(str(tmp_path / "plain" / "model.safetensors"))
    assert records.exported(tmp_path / "plain") is records.EAGLE3
    assert "parallel_drafting" not in records.EAGLE3.speculative_config(tmp_path / "plain", 3)


@pytest.mark.subprocess
@torch.inference_mode()
def test_vllm_reads_the_export_and_drafts_what_eaglet_computes(tmp_path):
    """vLLM's config reader turns parallel drafting on with the exported mask token, its
    drafter loads mask_hidden, and its one forward over the query its kernel lays out gives
    the logits of eaglet's forward (and so the drafts of the offline replay)."""
    pytest.importorskip("vllm")
    from tests.tiny_llama import HIDDEN, LAYERS, VOCAB, make_tiny_llama

    target = make_tiny_llama(tmp_path / "target")
    target_config = json.loads((tmp_path / "target" / "config.json").read_text())
    config = DrafterConfig.from_target(target_config, VOCAB // 2, [1, 2, LAYERS - 2])
    torch.manual_seed(0)
    draft_ids = torch.arange(0, VOCAB, 2)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft_ids] = True
    model = methods.make_drafter(
        "peagle",
        target_config,
        config,
        target.model.embed_tokens.weight.detach(),
        draft_ids - torch.arange(len(draft_ids)),
        t2d,
    )
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.2)
    model.eval()
    methods.export(model, tmp_path / "drafter")
    ids = torch.randint(0, VOCAB, (20,))
    aux = torch.randn(19, 3 * HIDDEN)
    anchors = [0, 7, 17]
    save_file(
        {"aux": aux, "ids": ids, "anchors": torch.tensor(anchors), "k": torch.tensor(K)},
        str(tmp_path / "inputs.safetensors"),
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.test_peagle",
            str(tmp_path / "target"),
            str(tmp_path / "drafter"),
            str(tmp_path / "inputs.safetensors"),
            str(tmp_path / "out.safetensors"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = load_file(str(tmp_path / "out.safetensors"))
    assert out["parallel_drafting"].item() and out["mask_token_id"].item() == model.mask_token_id
    torch.testing.assert_close(out["mask_hidden"].reshape(-1), model.mask_hidden)
    targets = model.to_target_ids(torch.arange(len(draft_ids)))
    for p in anchors:
        layout = out[f"positions.{p}"]
        assert layout.tolist() == list(range(p + K))
        assert out[f"ids.{p}"][p + 1 :].tolist() == [model.mask_token_id] * (K - 1)
        assert out[f"ids.{p}"][: p + 1].tolist() == ids[1 : p + 2].tolist()
        same_drafts_as_vllm(model, out[f"logits.{p}"], aux, ids, p, K, targets, t2d)


def same_drafts_as_vllm(model, theirs, aux, ids, p: int, k: int, targets, t2d) -> None:
    """vLLM's logits [k, target vocab] of the round after row ``p`` are the one-forward
    drafter's own (``model``: P-EAGLE or DFlash) at the draft vocabulary's target ids
    ``targets``, -inf elsewhere, and their argmax the offline replay's drafts."""
    ours = torch.stack(
        model(
            aux[: p + 1],
            ids[1 : p + 2].expand(k, p + 1),
            torch.arange(p + 1),
            torch.zeros(p + 1, dtype=torch.long),
            [torch.tensor([p])] * k,
        )
    ).squeeze(1)
    torch.testing.assert_close(theirs[:, targets], ours, rtol=1e-4, atol=1e-4)
    assert torch.isinf(theirs[:, ~t2d]).all()
    assert theirs.argmax(-1).tolist() == draft_parallel(model, aux, ids, p, k)


# -- the offline replay ----------------------------------------------------------------------


def test_offline_replay_counts_the_parallel_drafts_as_vllm_would():
    """On a tiny target's greedy answers: the counts satisfy vLLM's identities, each round's
    drafts are one parallel forward's, and a drafter trained on the answers accepts more."""
    from transformers import LlamaConfig, LlamaForCausalLM

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
    with torch.inference_mode():
        target.lm_head.weight.mul_(20)  # a peaked teacher: its greedy answers are learnable
        target.lm_head.weight[1::2] = 0  # and in the draft vocabulary (even ids)
    prompts = [[1, 5, 7, 9], [3, 4], [11, 2, 6]]
    with torch.inference_mode():
        sequences = [
            (
                p,
                target.generate(
                    torch.tensor([p]), do_sample=False, max_new_tokens=16, pad_token_id=0
                )[0, len(p) :].tolist(),
            )
            for p in prompts
        ]
    drafter = tiny_peagle(seed=4, embed=target.model.embed_tokens.weight.detach())
    before = offline_acceptance(target, drafter, sequences, k=3, draft=draft_parallel)
    assert before["draft_tokens"] == 3 * before["drafts"] > 0
    assert before["acceptance_length"] == pytest.approx(1 + sum(before["per_position_rate"]))

    # train on exactly these sequences (the teacher: the target's head on its final states)
    pieces = []
    for i, (prompt, completion) in enumerate(sequences):
        seq = torch.tensor(prompt + completion)
        with torch.no_grad():
            final = target.model(seq[None]).last_hidden_state[0]
            argmax = target.lm_head(final).argmax(-1)
        aux = target_features(target, drafter.config.aux_layer_ids, seq.tolist()).clone()
        pieces.append(
            (
                f"s{i}",
                seq,
                (torch.arange(len(seq)) >= len(prompt) - 1).to(torch.uint8),
                argmax,
                aux,
                final,
            )
        )
    batch = make_batch(pieces, 3, drafter.t2d, prompt_loss=True)
    head = target.lm_head.weight.detach()[drafter.to_target_ids(torch.arange(len(DRAFT_IDS)))]
    drafter.train()
    for param in drafter.parameters():
        torch.nn.init.normal_(param, std=0.05)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    for _ in range(150):
        ce, _ = batch_sums(drafter, batch, head)
        loss = (ce / batch.counts().clamp(min=1)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    drafter.eval()
    after = offline_acceptance(target, drafter, sequences, k=3, draft=draft_parallel)
    rates = after["per_position_rate"]
    assert all(a >= b for a, b in zip(rates, rates[1:]))  # a later position needs the earlier
    assert after["acceptance_length"] > before["acceptance_length"] + 0.5
    assert rates[1] > 0  # a masked slot's draft was accepted


# -- the vLLM side (a subprocess) -------------------------------------------------------------


def _vllm_side(target: str, drafter: str, inputs: str, out: str) -> None:
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
    from vllm.utils.cpu_triton_utils import _copy_and_expand_eagle_inputs_kernel_impl

    from tests.helpers.vllm_world import drafter_world

    data = load_file(inputs)
    k = int(data["k"])
    with drafter_world(
        target,
        {
            "method": "eagle3",
            "model": drafter,
            "num_speculative_tokens": k,
            "parallel_drafting": True,
        },
    ) as config:
        spec = config.speculative_config
        mask_id = spec.draft_model_config.hf_config.mask_token_id  # _init_parallel_drafting_params
        result = {
            "parallel_drafting": torch.tensor(spec.parallel_drafting),
            "mask_token_id": torch.tensor(mask_id),
        }
        model = Eagle3LlamaForCausalLM(vllm_config=config)
        model.load_weights(iter(load_file(f"{drafter}/model.safetensors").items()))
        result["mask_hidden"] = model.mask_hidden.clone()
        embed = load_file(f"{target}/model.safetensors")["model.embed_tokens.weight"]
        model.model.embed_tokens.weight[: embed.shape[0]].copy_(embed)
        process_weights_after_loading(model, spec.draft_model_config, torch.device("cpu"))
        attention = model.model.layers[0].self_attn
        heads, kv_heads, d = attention.num_heads, attention.num_kv_heads, attention.head_dim

        def causal(q, key, value, **_):  # one query, no cache: plain causal GQA softmax
            n = q.shape[0]
            group = heads // kv_heads
            keys = key.view(n, kv_heads, d).repeat_interleave(group, 1)
            values = value.view(n, kv_heads, d).repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q.view(n, heads, d), keys) * attention.scaling
            scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(n, heads * d)

        attention.attn.forward = causal
        # the proposer's load_model: the masked slots' hidden state
        mask_state = model.combine_hidden_states(model.mask_hidden.view(-1))
        aux, ids = data["aux"].float(), data["ids"]
        for p in data["anchors"].tolist():
            n_in, n_out = p + 1, p + k  # the target verified rows 0..p; k-1 new slots
            out_ids = torch.zeros(n_out, dtype=torch.int64)
            out_pos = torch.zeros(n_out, dtype=torch.int64)
            rejected = torch.zeros(n_out, dtype=torch.bool)
            masked = torch.zeros(n_out, dtype=torch.bool)
            sample = torch.zeros(k, dtype=torch.int32)
            mapping = torch.zeros(n_in, dtype=torch.int32)
            _copy_and_expand_eagle_inputs_kernel_impl(
                ids[:n_in],
                torch.arange(n_in),
                ids[n_in : n_in + 1],
                out_ids,
                out_pos,
                rejected,
                masked,
                sample,
                mapping,
                torch.tensor([0, n_in], dtype=torch.int32),
                torch.tensor([n_in - 1], dtype=torch.int32),
                0,
                mask_id,
                n_in,
                k,
                True,
            )
            hidden = torch.zeros(n_out, model.config.hidden_size)
            hidden[mapping.long()] = model.combine_hidden_states(aux[:n_in])
            hidden = torch.where(masked[:, None], mask_state, hidden)
            normed, _ = model(out_ids, out_pos, hidden)
            result[f"logits.{p}"] = model.compute_logits(normed[sample.long()])
            result[f"ids.{p}"], result[f"positions.{p}"] = out_ids, out_pos
    save_file({n: t.contiguous() for n, t in result.items()}, out)


if __name__ == "__main__":  # python -m tests.test_peagle TARGET DRAFTER INPUTS OUT
    _vllm_side(*sys.argv[1:5])
