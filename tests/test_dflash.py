"""DFlash (block drafting, ``train.method: dflash``): the training forward against each
block's own forward written out plainly, the loss, the export and its round trip, and the
export as vLLM loads and runs it.

The vLLM side runs in a subprocess (``python -m tests.test_dflash``: vLLM's process-wide
state stays out of the test process): vLLM's config reader, ``DFlashQwen3ForCausalLM`` built
with every parameter set to NaN and then loaded from the export (so a weight the export lacks
stays NaN, and one vLLM has no place for fails the load), the mask embedding read from
``mask_embedding.pt``, the context's keys and values computed by vLLM's own
``precompute_and_store_context_kv`` (caught where it writes them to the KV cache), and vLLM's
forward over the block with ``compute_logits``. Only the attention kernel, which needs the
engine's paged KV cache and metadata, is a plain softmax over the caught context and the block.
The served check (vLLM's counters against the offline replay) is in tests/test_workflow.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglet.core import methods as records
from eaglet.core.config import validate
from eaglet.model import dflash, methods
from eaglet.model.config import DrafterConfig
from eaglet.model.export import export_speculators
from eaglet.model.replay import draft_parallel
from eaglet.stages.evaluate import runs as evaluate_runs
from eaglet.stages.evaluate import schedule as evaluate_schedule
from eaglet.stages.train.data import make_batch
from eaglet.stages.train.step import batch_sums
from tests.helpers.paths import REPO
from tests.test_peagle import H, V, same_drafts_as_vllm
from tests.test_peagle import tiny_config as peagle_config
from tests.test_train import FAST, read_log, run, world  # noqa: F401 (world: a fixture)

K = 3


def tiny_config(**changes) -> DrafterConfig:
    """test_peagle's tiny drafter shape, its aux layers from 1 (DFlash's ids are one less)."""
    return peagle_config(**{"aux_layer_ids": [1, 2, 3], **changes})


def tiny_dflash(
    seed: int = 0,
    layers: int = 1,
    embed: torch.Tensor | None = None,
    config: DrafterConfig | None = None,
    mask_token_id: int = 1,
) -> dflash.DFlashDrafter:
    torch.manual_seed(seed)
    config = config or tiny_config()
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    draft_ids = torch.arange(0, config.vocab_size, 2)
    t2d[draft_ids] = True
    model = dflash.DFlashDrafter(
        config,
        torch.randn(config.vocab_size, config.hidden_size) if embed is None else embed,
        draft_ids - torch.arange(len(draft_ids)),
        t2d,
        mask_token_id,
        layers,
    )
    with torch.no_grad():
        for param in model.parameters():
            torch.nn.init.normal_(param, std=0.3)
    return model.eval()


# -- the forward: each block on its own, written out --------------------------------------------


def rms(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x, positions, theta=10000.0):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.cat([positions.double()[:, None] * inv[None]] * 2, -1)
    cos, sin = angles.cos().float()[:, None], angles.sin().float()[:, None]
    half = d // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def block_logits(model: dflash.DFlashDrafter, aux, ids, p: int, k: int) -> torch.Tensor:
    """The logits [k, Vd] of the block after context rows 0..p, as vLLM's proposer computes
    them: the context's keys from hidden_norm(fc(aux)), the block [ids[p+1], k masks] at
    positions p+1.., attention over context and block both ways, plain loops."""
    c = model.config
    nh, nkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    context = rms(aux[: p + 1] @ model.fc.weight.T, model.hidden_norm.weight)
    x = torch.stack([model.embed_tokens[ids[p + 1]]] + [model.mask_embedding] * k)
    ctx_pos, blk_pos = torch.arange(p + 1), torch.arange(p + 1, p + 2 + k)
    for layer in model.layers:
        a = layer.self_attn
        h = rms(x, layer.input_layernorm.weight)
        q = rotate(rms((h @ a.q_proj.weight.T).view(-1, nh, d), a.q_norm.weight), blk_pos)
        keys = []
        for states, pos in ((context, ctx_pos), (h, blk_pos)):
            kk = rms((states @ a.k_proj.weight.T).view(-1, nkv, d), a.k_norm.weight)
            keys.append((rotate(kk, pos), (states @ a.v_proj.weight.T).view(-1, nkv, d)))
        key = torch.cat([keys[0][0], keys[1][0]]).repeat_interleave(nh // nkv, 1)
        value = torch.cat([keys[0][1], keys[1][1]]).repeat_interleave(nh // nkv, 1)
        weights = (torch.einsum("qhd,khd->hqk", q, key) * d**-0.5).softmax(-1)
        out = torch.einsum("hqk,khd->qhd", weights, value).reshape(len(x), nh * d)
        x = x + out @ a.o_proj.weight.T
        m = rms(x, layer.post_attention_layernorm.weight)
        mlp = layer.mlp
        x = (
            x
            + (torch.nn.functional.silu(m @ mlp.gate_proj.weight.T) * (m @ mlp.up_proj.weight.T))
            @ mlp.down_proj.weight.T
        )
    return rms(x[1:], model.norm.weight) @ model.lm_head.weight.T


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@torch.inference_mode()
def test_training_forward_is_every_rows_block_on_its_own(layers, attention):
    """One packed forward of two samples gives, for every row t and slot j, the logits of the
    block anchored at t computed alone (context rows <= t of its own sample only)."""
    model = tiny_dflash(seed=3, layers=layers)
    model.attention = attention
    lengths = [9, 7]
    aux = torch.randn(sum(lengths), 3 * H)
    ids = torch.randint(0, V, (sum(lengths),))
    segments = torch.repeat_interleave(torch.arange(2), torch.tensor(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])
    step_ids = torch.stack(
        [ids[torch.clamp(torch.arange(len(ids)) + 1 + k, max=len(ids) - 1)] for k in range(K)]
    )
    ends = [lengths[0] - 1, sum(lengths) - 1]
    rows = torch.tensor([t for t in range(len(ids)) if t not in ends])
    logits = model(aux, step_ids, positions, segments, [rows] * K)
    for i, t in enumerate(rows.tolist()):
        start = 0 if t < lengths[0] else lengths[0]
        alone = block_logits(model, aux[start:], ids[start:], t - start, K)
        torch.testing.assert_close(torch.stack([z[i] for z in logits]), alone, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_the_masked_slots_read_no_token_and_the_block_sees_no_later_context():
    """Only the bonus token (step 0's ids) is read, and a row's block is blind to context rows
    after it: the drafts of row p change with neither."""
    model = tiny_dflash(seed=5)
    aux, ids = torch.randn(12, 3 * H), torch.randint(0, V, (12,))
    p = 6
    before = draft_parallel(model, aux, ids, p, K)
    later = ids.clone()
    later[p + 2 :] = (later[p + 2 :] + 1) % V
    moved = aux.clone()
    moved[p + 1 :] += 5
    assert draft_parallel(model, moved, later, p, K) == before
    bonus = ids.clone()
    bonus[p + 1] = (bonus[p + 1] + 1) % V
    changed = model(
        aux[: p + 1],
        bonus[1 : p + 2].expand(K, p + 1),
        torch.arange(p + 1),
        torch.zeros(p + 1, dtype=torch.long),
        [torch.tensor([p])] * K,
    )
    same = model(
        aux[: p + 1],
        ids[1 : p + 2].expand(K, p + 1),
        torch.arange(p + 1),
        torch.zeros(p + 1, dtype=torch.long),
        [torch.tensor([p])] * K,
    )
    assert not torch.allclose(changed[0], same[0])


def test_loss_falls_on_a_memorisable_batch_and_the_mask_embedding_learns():
    torch.manual_seed(0)
    model = tiny_dflash(seed=1).train()
    n = 24
    piece = (
        None,
        torch.randint(0, V, (n,)),
        torch.ones(n, dtype=torch.long),
        torch.randint(0, V // 2, (n,)) * 2,
        torch.randn(n, 3 * H),
        torch.randn(n, H),
    )
    batch = make_batch([piece], K, model.t2d)
    head = torch.randn(V // 2, H) * 3
    start = model.mask_embedding.detach().clone()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        ce, _ = batch_sums(model, batch, head, fused=True)
        loss = ce.sum() / batch.num_tokens
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.6 * losses[0]
    assert not torch.equal(model.mask_embedding.detach(), start)
    # the fused loss and the plain one agree on the same drafter
    model.eval()
    with torch.no_grad():
        fused, agree_f = batch_sums(model, batch, head, fused=True)
        plain, agree_p = batch_sums(model, batch, head, fused=False)
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-3)
    assert torch.equal(agree_f, agree_p)


def test_make_drafter_builds_dflash_on_the_targets_mask_token_and_refuses_what_vllm_cannot():
    target = {"vocab_size": V, "bos_token_id": 7}
    t2d = torch.ones(V, dtype=torch.bool)
    model = methods.make_drafter(
        "dflash",
        target,
        tiny_config(draft_vocab_size=V),
        torch.randn(V, H),
        torch.zeros(V, dtype=torch.long),
        t2d,
        2,
    )
    assert isinstance(model, dflash.DFlashDrafter)
    assert model.mask_token_id == 7 and model.num_layers == 2
    torch.testing.assert_close(model.mask_embedding, model.embed_tokens[7])
    for bad in ({"fc_norm": True}, {"attention_kind": "mla"}):
        with pytest.raises(ValueError, match="dflash"):
            methods.make_drafter(
                "dflash",
                target,
                tiny_config(**bad),
                torch.randn(V, H),
                torch.zeros(V // 2, dtype=torch.long),
                t2d,
            )


@pytest.mark.subprocess  # heavy in-process: 12 s
def test_train_method_dflash_trains_exports_and_never_resumes_another_method(world, tmp_path):
    """``train.method: dflash`` through the training run: the losses fall, every slot learns,
    the export is the DFlash drafter (the target's bos as mask token, the block of ttt_steps +
    1, the layers asked for) and loads back; a P-EAGLE run over its checkpoints starts over."""
    result = run(world, tmp_path, {**FAST, "epochs": 4, "method": "dflash", "dflash_layers": 2})
    out = tmp_path / "run" / "drafter"
    trained = [r for r in read_log(out / "training_log.csv") if r["split"] == "train"]
    assert float(trained[-1]["loss"]) < 0.5 * float(trained[0]["loss"])
    assert float(trained[-1][f"acc_{FAST['ttt_steps'] - 1}"]) > 0  # the last slot learned too
    config = json.loads((out / "config.json").read_text())
    target = json.loads((Path(world["target"]) / "config.json").read_text())
    assert config["dflash_config"]["mask_token_id"] == target["bos_token_id"]
    assert config["block_size"] == FAST["ttt_steps"] + 1 and config["num_hidden_layers"] == 2
    assert isinstance(methods.load(out, world["target"]), dflash.DFlashDrafter)
    assert result["resumed_from_step"] == 0
    again = run(world, tmp_path, {**FAST, "method": "peagle"})
    assert again["resumed_from_step"] == 0
    assert records.exported(out) is records.PEAGLE


@torch.inference_mode()
def test_layer_init_target_starts_every_layer_as_the_targets_last(world):
    """train.layer_init: target for DFlash: each layer takes the target's last layer where it
    fits (a Llama layer: all but q_norm and k_norm, which it lacks and which stay at 1), the
    context's hidden_norm its input norm, the final norm the target's; fc passes the deepest
    aux feature through."""
    from safetensors.torch import load_file as read

    target_config = json.loads((Path(world["target"]) / "config.json").read_text())
    config = DrafterConfig.from_target(target_config, 64, [1, 2, 3])
    vocab = config.vocab_size
    model = methods.make_drafter(
        "dflash",
        target_config,
        config,
        torch.randn(vocab, 64),
        torch.zeros(64, dtype=torch.long),
        torch.ones(vocab, dtype=bool),
        2,
    )
    fit = methods.init_layer_from_target(model, world["target"], 3)
    assert set(fit.parts) == {"attention", "mlp"} and not fit.reasons
    weights = read(str(Path(world["target"]) / "model.safetensors"))
    for layer in model.layers:
        for name, param in layer.named_parameters():
            stored = weights.get(f"model.layers.3.{name}")
            if stored is None:  # q_norm, k_norm: a Llama layer has none
                assert name.endswith(("q_norm.weight", "k_norm.weight")), name
                assert torch.equal(param, torch.ones_like(param))
            else:
                assert torch.equal(param, stored), name
    assert torch.equal(model.hidden_norm.weight, weights["model.layers.3.input_layernorm.weight"])
    assert torch.equal(model.norm.weight, weights["model.norm.weight"])
    aux = torch.randn(5, 3 * 64)
    torch.testing.assert_close(model.fc(aux), aux[:, -64:])


@torch.inference_mode()
def test_export_round_trips_with_the_config_vllm_reads(tmp_path):
    model = tiny_dflash(seed=2, layers=2)
    config = methods.export(model, tmp_path / "drafter", block_size=K + 1)
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["num_hidden_layers"] == 2 and config["block_size"] == K + 1
    assert config["layer_types"] == ["full_attention"] * 2
    # vLLM adds 1 to DFlash's target layer ids; the top-level ids are read first, unchanged
    assert config["dflash_config"] == {
        "mask_token_id": 1,
        "target_layer_ids": [0, 1, 2],
        "causal": False,
    }
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert "eagle_config" not in config and config["rope_theta"] == 10000.0
    weights = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    assert set(weights) == set(dflash.vllm_tensors(model))
    assert not any(n.startswith("model.") or "mask" in n for n in weights)
    mask = torch.load(tmp_path / "drafter" / dflash.MASK_EMBEDDING_FILE, weights_only=True)
    assert mask["mask_token_id"] == 1
    torch.testing.assert_close(mask["embedding"], model.mask_embedding)
    assert records.exported(tmp_path / "drafter") is records.DFLASH
    assert records.DFLASH.speculative_config(tmp_path / "drafter", K) == {
        "method": "dflash",
        "model": str(tmp_path / "drafter"),
        "num_speculative_tokens": K,
    }
    # the round trip: the same drafts from the same states
    target = tmp_path / "target"
    target.mkdir()
    save_file(
        {"model.embed_tokens.weight": model.embed_tokens.contiguous()},
        str(target / "model.safetensors"),
    )
    (target / "config.json").write_text(json.dumps({"vocab_size": V, "hidden_size": H}))
    loaded = methods.load(tmp_path / "drafter", target)
    assert isinstance(loaded, dflash.DFlashDrafter) and loaded.num_layers == 2
    aux, ids = torch.randn(10, 3 * H), torch.randint(0, V, (10,))
    for p in (0, 4, 8):
        assert draft_parallel(loaded, aux, ids, p, K) == draft_parallel(model, aux, ids, p, K)
    assert methods.draft_function(loaded) is draft_parallel
    # the evaluation names, serves and tables it by its method and depth
    assert evaluate_runs.drafter_kind(tmp_path / "drafter") == (
        "dflash",
        "dflash",
        "DFlash, 2 layers",
    )
    ev = validate({"evaluate": {"num_speculative_tokens": [1, K]}})["evaluate"]
    plan, _ = evaluate_schedule.sweep_runs(ev, str(tmp_path / "drafter"))
    drafted = [r for r in plan if evaluate_runs.is_drafter(r)]
    assert [r["name"] for r in drafted] == ["dflash_k1", f"dflash_k{K}"]
    assert evaluate_runs.speculative_config(drafted[-1]) == {
        "method": "dflash",
        "model": str(tmp_path / "drafter"),
        "num_speculative_tokens": K,
    }
    # the speculators format describes EAGLE-3 drafters only: the refusal says how to serve it
    with pytest.raises(ValueError, match='"method": "dflash"'):
        export_speculators(tmp_path / "drafter", tmp_path / "speculators", str(target), K)


# -- vLLM loads the export and drafts what eaglet computes ---------------------------------------


@pytest.mark.subprocess
@pytest.mark.parametrize("layers", [1, 2])
@torch.inference_mode()
def test_vllm_loads_every_weight_and_drafts_what_eaglet_computes(tmp_path, layers):
    """vLLM's DFlash model loads every tensor of the export (none left NaN but the embedding
    it shares with the target) and the mask embedding; its context keys and values (its own
    fused projection, grouped key norm and RoPE) and its forward over the block give the
    logits of eaglet's forward, and so the drafts of the offline replay. Two layers check the
    grouped key norm across layers, which vLLM's CPU kernel gets wrong without eaglet's
    plugin (``eaglet.engine.plugin``)."""
    pytest.importorskip("vllm")
    from tests.tiny_llama import LAYERS, make_tiny_llama

    make_tiny_llama(tmp_path / "target")
    target_config = json.loads((tmp_path / "target" / "config.json").read_text())
    config = DrafterConfig.from_target(
        target_config, target_config["vocab_size"] // 2, [1, 2, LAYERS - 2]
    )
    vocab = config.vocab_size
    draft_ids = torch.arange(0, vocab, 2)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    embed = load_file(str(tmp_path / "target" / "model.safetensors"))["model.embed_tokens.weight"]
    torch.manual_seed(0)
    model = methods.make_drafter(
        "dflash",
        target_config,
        config,
        embed,
        draft_ids - torch.arange(len(draft_ids)),
        t2d,
        layers,
    )
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.2)
    model.eval()
    methods.export(model, tmp_path / "drafter", block_size=K + 1)
    ids = torch.randint(0, vocab, (20,))
    aux = torch.randn(19, config.fc_input_size)
    anchors = [0, 7, 17]
    save_file(
        {"aux": aux, "ids": ids, "anchors": torch.tensor(anchors), "k": torch.tensor(K)},
        str(tmp_path / "inputs.safetensors"),
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.test_dflash",
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
    assert out["nan_params"].item() == 0, done.stdout[-2000:]
    assert out["has_mask_embedding"].item() == 1
    torch.testing.assert_close(out["mask_embedding"], model.mask_embedding)
    assert out["mask_token_id"].item() == model.mask_token_id
    targets = model.to_target_ids(torch.arange(len(draft_ids)))
    for p in anchors:
        same_drafts_as_vllm(model, out[f"logits.{p}"], aux, ids, p, K, targets, t2d)


def _vllm_side(target: str, drafter: str, inputs: str, out: str) -> None:
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

    from eaglet.engine import plugin
    from tests.helpers.vllm_world import drafter_world

    plugin.register()  # as the engine does at start (its entry point), and then its worker:
    plugin.fix_grouped_norm_if_needed()
    data = load_file(inputs)
    k = int(data["k"])
    spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": k}
    with drafter_world(target, spec) as config:
        spec = config.speculative_config
        hf = spec.draft_model_config.hf_config
        result = {"mask_token_id": torch.tensor(hf.dflash_config["mask_token_id"])}
        model = DFlashQwen3ForCausalLM(vllm_config=config)
        for param in model.parameters():  # ids (d2t) are never negative
            param.fill_(float("nan") if param.is_floating_point() else -1)
        model.load_weights(iter(load_file(f"{drafter}/model.safetensors").items()))
        nan = [
            n
            for n, p in model.named_parameters()
            if "embed_tokens" not in n
            and (torch.isnan(p).any() if p.is_floating_point() else (p < 0).any())
        ]
        print("left NaN:", nan)
        result["nan_params"] = torch.tensor(len(nan))
        result["has_mask_embedding"] = torch.tensor(int(model.model.has_separate_mask_embedding))
        result["mask_embedding"] = model.model.mask_embedding.clone()
        embed = load_file(f"{target}/model.safetensors")["model.embed_tokens.weight"]
        model.model.embed_tokens.weight[: embed.shape[0]].copy_(embed)
        process_weights_after_loading(model, spec.draft_model_config, torch.device("cpu"))
        layers = [layer.self_attn for layer in model.model.layers]
        caught: dict[int, tuple] = {}

        def catch(i):
            def update(attn, key, value, kv_cache, slot_mapping):
                caught[i] = (key.clone(), value.clone())

            return update

        for i, attn in enumerate(layers):
            attn.attn.impl.do_kv_cache_update = catch(i)

        def attend(i, attn):
            heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim

            def both_ways(q, key, value, **_):  # the block over the context and itself
                ctx_k, ctx_v = caught[i]
                keys = torch.cat([ctx_k.reshape(-1, kv_heads, d), key.view(-1, kv_heads, d)])
                values = torch.cat([ctx_v.reshape(-1, kv_heads, d), value.view(-1, kv_heads, d)])
                group = heads // kv_heads
                keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
                n = q.shape[0]
                scores = torch.einsum("qhd,khd->hqk", q.view(n, heads, d), keys) * attn.scaling
                return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(n, -1)

            return both_ways

        for i, attn in enumerate(layers):
            attn.attn.forward = attend(i, attn)
        mask_id = int(result["mask_token_id"])
        aux, ids = data["aux"].float(), data["ids"]
        for p in data["anchors"].tolist():
            context = model.combine_hidden_states(aux[: p + 1])
            model.precompute_and_store_context_kv(context, torch.arange(p + 1), torch.arange(p + 1))
            block = torch.cat([ids[p + 1 : p + 2], torch.full((k,), mask_id)])
            hidden = model(block, torch.arange(p + 1, p + 2 + k))
            result[f"logits.{p}"] = model.compute_logits(hidden[1:])
    save_file({n: t.contiguous() for n, t in result.items()}, out)


if __name__ == "__main__":  # python -m tests.test_dflash TARGET DRAFTER INPUTS OUT
    _vllm_side(*sys.argv[1:5])
