"""EAGLE-3.1 and the other norms vLLM reads from a drafter's config.json
(``train.drafter_variant``): each is applied where vLLM's forward applies it, exported under
the names and keys vLLM reads, read back into the same model, and a checkpoint of one variant
is never resumed by the other.

The reference drafts one query at a time with the norms written out from vLLM 0.32's
llama_eagle3.py: ``combine_hidden_states`` (input_norm over the concatenated aux features,
then one fc_norm per feature, then fc); the layer's residual starting at the hidden state or,
with norm_before_residual, at its hidden_norm; lm_head reading the final-normed state, and
the next step reading the pre-norm state or, with norm_output, the final-normed one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from eaglet.core.methods import EAGLE31
from eaglet.model.config import NORM_FLAGS, DrafterConfig, config_from_vllm
from eaglet.model.drafter import Eagle3Drafter
from eaglet.model.export import export_drafter, export_speculators, load_drafter, vllm_tensors
from eaglet.model.replay import draft_chain
from eaglet.stages.train import checkpoints as ckpt
from eaglet.stages.train.data import TrainError
from eaglet.stages.train.loop import settings
from tests.helpers.paths import HELPERS
from tests.test_drafter import DRAFT_VOCAB, VOCAB, H, K, run_batch, sample, tiny_config, vocab_map

# every flag at least once, alone and with the others it is combined with
FLAG_SETS = {
    "eagle3.1": EAGLE31.flags,
    "fc_norm": {"fc_norm": True},
    "norm_output": {"norm_output": True},
    "norm_before_fc": {"norm_before_fc": True},
    "norm_before_residual": {"norm_before_residual": True},
    "all but fc_norm": {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True},
}
# the config.json keys of an EAGLE-3 export before the variants existed
EAGLE3_KEYS = {
    "architectures",
    "model_type",
    "num_key_value_heads",
    "head_dim",
    "mlp_bias",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "hidden_act",
    "rms_norm_eps",
    "rope_parameters",
    "rope_theta",
    "max_position_embeddings",
    "vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
    "tie_word_embeddings",
    "attention_bias",
    "eagle_config",
    "dtype",
    "torch_dtype",
}


def flagged_model(flags: dict, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    d2t, t2d = vocab_map()
    model = Eagle3Drafter(replace(tiny_config(), **flags), torch.randn(VOCAB, H), d2t, t2d)
    with torch.no_grad():  # norms away from 1 so that a misplaced or skipped norm shows
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    return model.eval()


def scaled_sample(length: int, seed: int) -> tuple:
    """``sample`` with its three aux features at scales 1, 10 and 100, as a target's layers
    differ: where fc_norm sits matters."""
    piece = sample(length, seed)
    scale = torch.tensor([1.0, 10.0, 100.0]).repeat_interleave(H)
    return (*piece[:4], piece[4] * scale, piece[5])


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def reference_logits(
    model: Eagle3Drafter, piece, flags: dict
) -> dict[tuple[int, int], torch.Tensor]:
    """{(row t, step k): logits} drafting one query at a time with ``flags`` (NORM_FLAGS)."""
    _, ids, _, _, aux, _ = piece
    on = {name: flags.get(name, False) for name in NORM_FLAGS}
    layer, attn, c = model.midlayer, model.midlayer.self_attn, model.config
    eps = c.rms_norm_eps
    rope = LlamaRotaryEmbedding(
        LlamaConfig(
            hidden_size=H,
            num_attention_heads=c.num_attention_heads,
            head_dim=c.head_dim,
            rope_parameters=c.rope_parameters,
        )
    )

    def combine(a):
        if on["norm_before_fc"]:
            a = rms(a, model.input_norm.weight, eps)
        if on["fc_norm"]:
            a = torch.cat(
                [rms(a[i * H : (i + 1) * H], model.fc_norm[i].weight, eps) for i in range(3)]
            )
        return model.fc(a)

    def project(token, hidden, position):
        normed = rms(hidden, layer.hidden_norm.weight, eps)
        x = torch.cat([rms(model.embed_tokens[token], layer.input_layernorm.weight, eps), normed])
        q = attn.q_proj(x).view(1, c.num_attention_heads, 1, c.head_dim)
        k = attn.k_proj(x).view(1, c.num_key_value_heads, 1, c.head_dim)
        v = attn.v_proj(x).view(c.num_key_value_heads, c.head_dim)
        cos, sin = rope(x[None], torch.tensor([[position]]))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return normed, q[0, :, 0], k[0, :, 0], v

    def finish(hidden, normed, q, keys, values):
        group = c.num_attention_heads // c.num_key_value_heads
        heads = []
        for h in range(c.num_attention_heads):
            scores = torch.stack([q[h] @ k[h // group] for k in keys]) / c.head_dim**0.5
            heads.append(sum(w * v[h // group] for w, v in zip(torch.softmax(scores, 0), values)))
        residual = normed if on["norm_before_residual"] else hidden
        residual = residual + attn.o_proj(torch.cat(heads))
        residual = residual + layer.mlp(rms(residual, layer.post_attention_layernorm.weight, eps))
        final = rms(residual, model.norm.weight, eps)
        return (final if on["norm_output"] else residual), model.lm_head(final)

    length = len(ids)
    token = lambda i: ids[min(i, length - 1)]  # noqa: E731 (past the end: the last token)
    step0 = [project(token(t + 1), combine(aux[t]), t) for t in range(length)]
    out = {}
    for t in range(length):
        normed, q, _, _ = step0[t]
        keys = [step0[j][2] for j in range(t + 1)]
        values = [step0[j][3] for j in range(t + 1)]
        hidden, out[t, 0] = finish(combine(aux[t]), normed, q, keys, values)
        for k in range(1, K):
            normed, q, key, value = project(token(t + 1 + k), hidden, t + k)
            keys, values = keys + [key], values + [value]
            hidden, out[t, k] = finish(hidden, normed, q, keys, values)
    return out


def target_dir(tmp_path: Path, model: Eagle3Drafter) -> Path:
    """A target directory holding just the embedding ``load_drafter`` reads."""
    out = tmp_path / "target"
    out.mkdir(exist_ok=True)
    save_file({"model.embed_tokens.weight": model.embed_tokens}, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return out


# -- the setting ------------------------------------------------------------------------------


def test_the_variant_sets_its_flags_and_unknown_or_unservable_ones_are_refused():
    target = {
        "hidden_size": H,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
    }
    plain = DrafterConfig.from_target(target, DRAFT_VOCAB, [1, 2, 3])
    assert plain.norm_flags == dict.fromkeys(NORM_FLAGS, False)
    assert plain == DrafterConfig.from_target(target, DRAFT_VOCAB, [1, 2, 3], variant="eagle3")
    v31 = DrafterConfig.from_target(target, DRAFT_VOCAB, [1, 2, 3], variant="eagle3.1")
    assert v31.norm_flags == {
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": True,
        "norm_output": True,
    }
    assert replace(v31, **dict.fromkeys(NORM_FLAGS, False)) == plain  # nothing else changes
    with pytest.raises(ValueError, match="drafter_variant 'eagle4' is none of eagle3, eagle3.1"):
        DrafterConfig.from_target(target, DRAFT_VOCAB, [1, 2, 3], variant="eagle4")
    with pytest.raises(ValueError, match="norm_before_fc.*deepseek_eagle3.*fc_norm"):
        replace(plain, attention_kind="mla", norm_before_fc=True)
    assert settings({})["drafter_variant"] == "eagle3"
    with pytest.raises(TrainError, match="drafter_variant"):
        settings({"drafter_variant": "eagle3.2"})


def test_a_checkpoint_of_the_other_variant_is_not_resumed(tmp_path):
    """The variant is part of the fingerprint: an unfinished training of the other variant
    stops the run with the setting named, instead of loading weights of another shape."""
    was = ckpt.fingerprint(settings({"drafter_variant": "eagle3"}), [], 1, "vocab")
    now = ckpt.fingerprint(settings({"drafter_variant": "eagle3.1"}), [], 1, "vocab")
    assert ckpt.fingerprint_differences(was, now) == ["drafter_variant"]
    assert not ckpt.same_training(was, now) and ckpt.same_training(now, now)
    model = flagged_model({})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1)
    ckpt.save(
        tmp_path,
        5,
        model,
        optimizer,
        schedule,
        {"fingerprint": was, "step": 5, "total_steps": 50},
        2,
    )
    with pytest.raises(TrainError, match="drafter_variant differ"):
        ckpt.to_resume(tmp_path, now, True, 0)
    assert ckpt.to_resume(tmp_path, was, True, 0) is not None


# -- the model --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FLAG_SETS))
def test_each_flag_is_applied_where_vllms_forward_applies_it(name):
    """The batched TTT forward equals the one-query reference with the flags, and not the
    reference without them (each flag changes the logits); offline drafting's chain is the
    argmax chain of the same model."""
    flags = FLAG_SETS[name]
    model = flagged_model(flags)
    pieces = [scaled_sample(9, 1), scaled_sample(6, 2)]
    with torch.no_grad():
        batch, logits = run_batch(model, pieces)
        starts = [0, len(pieces[0][1])]
        for piece, start in zip(pieces, starts):
            reference = reference_logits(model, piece, flags)
            without = reference_logits(model, piece, {})
            for (t, k), expected in reference.items():
                torch.testing.assert_close(logits[k][start + t], expected, rtol=1e-5, atol=1e-5)
            assert max((reference[key] - without[key]).abs().max() for key in reference) > 1e-2

    _, ids, _, _, aux, _ = pieces[0]
    p, k = len(ids) - 5, 3
    drafts = draft_chain(model, aux, ids, p, k)
    steps = torch.stack([ids[1 + j : p + 2 + j] for j in range(k)])
    for j in range(1, k):
        steps[j, p] = drafts[j - 1]
    with torch.no_grad():
        chain = model(
            aux[: p + 1], steps, torch.arange(p + 1), torch.zeros(p + 1, dtype=torch.long)
        )
    assert drafts == [int(model.to_target_ids(z[p].argmax())) for z in chain]


# -- the export -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FLAG_SETS))
def test_the_export_writes_the_flags_and_norms_vllm_reads_and_loads_back_the_same(tmp_path, name):
    flags = FLAG_SETS[name]
    model = flagged_model(flags, seed=3)
    config = export_drafter(model, tmp_path / "drafter")
    assert {flag: config[flag] for flag in NORM_FLAGS} == {
        flag: flags.get(flag, False) for flag in NORM_FLAGS
    }
    assert set(config) == EAGLE3_KEYS | set(NORM_FLAGS)
    expected = vllm_tensors(model.config)
    with safe_open(str(tmp_path / "drafter" / "model.safetensors"), framework="pt") as handle:
        shapes = {n: tuple(handle.get_slice(n).get_shape()) for n in handle.keys()}
    assert shapes == {n: shape for n, (shape, _) in expected.items()}
    new = {n: expected[n][1] for n in shapes if n.startswith(("fc_norm.", "input_norm."))}
    assert new == (
        {f"fc_norm.{i}.weight": f"model.fc_norm.{i}.weight" for i in range(3)}
        if flags.get("fc_norm")
        else {}
    ) | ({"input_norm.weight": "model.input_norm.weight"} if flags.get("norm_before_fc") else {})

    loaded = load_drafter(tmp_path / "drafter", target_dir(tmp_path, model))
    assert loaded.config == model.config
    pieces = [scaled_sample(7, 1), scaled_sample(5, 2)]
    with torch.no_grad():
        _, before = run_batch(model, pieces)
        _, after = run_batch(loaded, pieces)
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_eagle3_export_keeps_its_config_keys_and_older_configs_read_as_eagle3(tmp_path):
    """The default writes the same config.json keys as before the variants existed; a
    config.json without the flags (every EAGLE-3 drafter trained before) reads back with
    all of them off, as vLLM reads it."""
    model = flagged_model({})
    config = export_drafter(model, tmp_path / "drafter")
    assert set(config) == EAGLE3_KEYS
    assert config_from_vllm(config).norm_flags == dict.fromkeys(NORM_FLAGS, False)
    loaded = load_drafter(tmp_path / "drafter", target_dir(tmp_path, model))
    assert loaded.config == model.config
    eagle_config = {**config["eagle_config"], "norm_before_fc": True}  # where vLLM looks first
    assert config_from_vllm({**config, "eagle_config": eagle_config}).norm_before_fc


def test_vllms_config_readers_get_the_flags_as_set(tmp_path):
    """vLLM's own readers: the config it builds for ``--speculative-config`` (get_config,
    then EAGLEConfig, what SpeculativeConfig does) and the speculators reader of
    ``vllm serve DIR`` (whose default for norm_before_residual would be true) see each flag
    as the variant set it."""
    pytest.importorskip("vllm")
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    for name, flags in [("eagle3", {}), *FLAG_SETS.items()]:
        out = tmp_path / name.replace(" ", "_")
        model = flagged_model(flags)
        export_drafter(model, out / "drafter")
        read = EAGLEConfig(
            get_config(str(out / "drafter"), trust_remote_code=False),
            method="eagle3",
            model_type="eagle",
        )
        assert read.architectures == ["LlamaForCausalLMEagle3"]
        want = {flag: flags.get(flag, False) for flag in NORM_FLAGS}
        assert {flag: getattr(read, flag, False) for flag in NORM_FLAGS} == want, name

        spec = export_speculators(out / "drafter", out / "spec", str(target_dir(out, model)), 3)
        assert not set(NORM_FLAGS) & set(spec["transformer_layer_config"])
        layer = SpeculatorsConfig.extract_transformers_pre_trained_config(
            json.loads(json.dumps(spec))
        )
        assert {flag: layer[flag] for flag in NORM_FLAGS} == want, name


# -- vLLM's own forward -----------------------------------------------------------------------


def vllm_forward(
    helper: Path, target: str, drafter: Path, aux, ids, p: int, k: int, tmp_path: Path
) -> dict[str, torch.Tensor]:
    """What ``helper`` (tests/helpers) computes with vLLM's drafter model on the export."""
    save_file(
        {"aux": aux, "ids": ids, "p": torch.tensor(p), "k": torch.tensor(k)},
        str(tmp_path / "inputs.safetensors"),
    )
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    done = subprocess.run(
        [
            sys.executable,
            str(helper),
            target,
            str(drafter),
            str(tmp_path / "inputs.safetensors"),
            str(tmp_path / "vllm.safetensors"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return load_file(str(tmp_path / "vllm.safetensors"))


SHARD_ORDER = {"q": 0, "k": 1, "v": 2, "0": 0, "1": 1}  # how vLLM stacks fused weights


def stacked(exported: dict[str, torch.Tensor], expected: dict) -> dict[str, torch.Tensor]:
    """vLLM parameter -> the exported tensors it receives (``vllm_tensors``: ``NAME[shard]``
    for a stacked parameter), concatenated in the order vLLM's weight loader stacks them."""
    parts: dict[str, list[tuple[int, str]]] = {}
    for name, (_, destination) in expected.items():
        if destination.startswith("("):  # not loaded (t2d)
            continue
        base, _, shard = destination.partition("[")
        param = f"{base}.weight" if shard else base
        parts.setdefault(param, []).append((SHARD_ORDER.get(shard.rstrip("]"), 0), name))
    return {
        param: torch.cat([exported[name] for _, name in sorted(names)])
        for param, names in parts.items()
    }


def check_vllm_equals_eaglet(out: dict, model: Eagle3Drafter, exported: dict, aux, ids, p, k):
    """Every exported tensor sits where ``vllm_tensors`` says vLLM puts it, and vLLM's chain
    of k draft logits equals eaglet's training forward and offline chain."""
    loaded = {n[len("loaded.") :]: t for n, t in out.items() if n.startswith("loaded.")}
    wanted = stacked(exported, vllm_tensors(model.config))
    assert set(loaded) - set(wanted) == {"model.embed_tokens.weight"}  # shared from the target
    for param, want in wanted.items():  # lm_head's rows are padded to a multiple of 64
        torch.testing.assert_close(loaded[param][: len(want)], want, rtol=0, atol=0, msg=param)
    drafts = [int(out[f"logits.{j}"].argmax()) for j in range(k)]
    steps = torch.stack([ids[1 + j : p + 2 + j] for j in range(k)])
    for j in range(1, k):
        steps[j, p] = drafts[j - 1]
    with torch.no_grad():
        ours = model(aux[: p + 1], steps, torch.arange(p + 1), torch.zeros(p + 1, dtype=torch.long))
    draft_ids = torch.arange(model.config.draft_vocab_size) + model.d2t
    for j in range(k):
        theirs = out[f"logits.{j}"]
        assert torch.isfinite(theirs).sum() == model.config.draft_vocab_size
        # float32 forwards of two implementations sum in other orders: on one machine 2 of 40
        # logits differed by 7e-5 (a weight in the wrong place differs by whole units)
        torch.testing.assert_close(theirs[draft_ids], ours[j][p], rtol=1e-3, atol=1e-4)
    assert draft_chain(model, aux, ids, p, k) == drafts


@pytest.mark.subprocess
@pytest.mark.parametrize("name", ["eagle3", "eagle3.1", "all but fc_norm"])
def test_vllms_llama_drafter_loads_the_export_and_drafts_what_eaglet_drafts(tmp_path, name):
    """vLLM's Eagle3LlamaForCausalLM, built from the engine config of --speculative-config
    beside a tiny Llama target and loaded by its own load_weights, applies the flags it read
    (all four between these variants) and its forward chain equals eaglet's."""
    if importlib.util.find_spec("vllm") is None:  # found, not imported: the helper runs it
        pytest.skip("vLLM is not installed")
    from tests.tiny_llama import HIDDEN, LAYERS, make_tiny_llama
    from tests.tiny_llama import VOCAB as TARGET_VOCAB

    flags = {} if name == "eagle3" else FLAG_SETS[name]
    target = make_tiny_llama(tmp_path / "target")
    config = DrafterConfig.from_target(target.config.to_dict(), 40, [1, 3, LAYERS - 2])
    gen = torch.Generator().manual_seed(5)
    keep = torch.sort(torch.randperm(TARGET_VOCAB, generator=gen)[:40]).values
    t2d = torch.zeros(TARGET_VOCAB, dtype=torch.bool)
    t2d[keep] = True
    torch.manual_seed(6)
    model = Eagle3Drafter(
        replace(config, **flags),
        target.model.embed_tokens.weight.detach(),
        keep - torch.arange(40),
        t2d,
    )
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.uniform_(0.5, 1.5)
            else:  # logits far enough apart that float rounding picks no other argmax
                param.mul_(4)
    model.eval()
    export_drafter(model, tmp_path / "drafter")
    length, p, k = 14, 9, 3
    aux = torch.randn(length, 3 * HIDDEN, generator=gen) * torch.tensor(
        [1.0, 4.0, 16.0]
    ).repeat_interleave(HIDDEN)
    ids = torch.randint(0, TARGET_VOCAB, (length + 1,), generator=gen)
    out = vllm_forward(
        HELPERS / "vllm_llama_drafter.py",
        str(tmp_path / "target"),
        tmp_path / "drafter",
        aux,
        ids,
        p,
        k,
        tmp_path,
    )
    assert {f: bool(out[f"flags.{f}"]) for f in NORM_FLAGS} == {
        f: flags.get(f, False) for f in NORM_FLAGS
    }
    exported = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    check_vllm_equals_eaglet(out, model, exported, aux, ids, p, k)


@pytest.mark.subprocess
def test_vllms_mla_drafter_applies_the_eagle31_flags_as_eaglet_does(tmp_path):
    """The same for vLLM's Eagle3DeepseekV2ForCausalLM and an EAGLE-3.1 MLA drafter of a
    tiny DeepSeek-V3 target: fc_norm before fc, the normed state fed back."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    from tests.test_drafter_mla import AUX_LAYERS, HIDDEN, make_mla_target
    from tests.test_train import DRAFT_VOCAB as MLA_DRAFT_VOCAB
    from tests.test_train import VOCAB as MLA_VOCAB

    target = make_mla_target(tmp_path / "target")
    config = DrafterConfig.from_target(
        target.config.to_dict(), MLA_DRAFT_VOCAB, AUX_LAYERS, "mla", "eagle3.1"
    )
    gen = torch.Generator().manual_seed(5)
    keep = torch.sort(torch.randperm(MLA_VOCAB, generator=gen)[:MLA_DRAFT_VOCAB]).values
    t2d = torch.zeros(MLA_VOCAB, dtype=torch.bool)
    t2d[keep] = True
    torch.manual_seed(6)
    model = Eagle3Drafter(
        config, target.model.embed_tokens.weight.detach(), keep - torch.arange(MLA_DRAFT_VOCAB), t2d
    )
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.uniform_(0.5, 1.5)
    model.eval()
    written = export_drafter(model, tmp_path / "drafter")
    assert (written["fc_norm"], written["norm_output"], written["norm_before_fc"]) == (
        True,
        True,
        False,
    )
    length, p, k = 14, 9, 3
    aux = torch.randn(length, 3 * HIDDEN, generator=gen) * torch.tensor(
        [1.0, 4.0, 16.0]
    ).repeat_interleave(HIDDEN)
    ids = torch.randint(0, MLA_VOCAB, (length + 1,), generator=gen)
    out = vllm_forward(
        HELPERS / "vllm_mla_drafter.py",
        str(tmp_path / "target"),
        tmp_path / "drafter",
        aux,
        ids,
        p,
        k,
        tmp_path,
    )
    exported = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    check_vllm_equals_eaglet(out, model, exported, aux, ids, p, k)
