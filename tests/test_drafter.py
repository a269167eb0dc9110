"""The drafter model, its TTT attention, the loss, and the exported checkpoint's layout.

The reference here drafts the way vLLM's EAGLE-3 proposer does, one query at a time with
an explicit KV list: at row t, step 0 embeds token t+1 over fc(aux[t]) at position t and
caches its keys; step k embeds token t+1+k over the previous step's pre-norm output at
position t+k and attends to the step-0 keys of rows <= t plus its own keys of steps 1..k.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from eaglet.model import attention, drafter
from eaglet.model import config as model_config
from eaglet.model import init as drafter_init
from eaglet.model.config import DrafterConfig, rope_parameters
from eaglet.model.drafter import Eagle3Drafter
from eaglet.model.export import export_drafter, export_speculators, load_drafter
from eaglet.stages.train.data import make_batch
from eaglet.stages.train.step import batch_sums, summarize
from eaglet.target.checkpoint import load_target_layer

H, VOCAB, DRAFT_VOCAB, K = 32, 50, 30, 4


def tiny_config(rope=None) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=H,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_parameters=rope or {"rope_theta": 10000.0, "rope_type": "default"},
        max_position_embeddings=128,
        vocab_size=VOCAB,
        draft_vocab_size=DRAFT_VOCAB,
        target_hidden_size=H,
        aux_layer_ids=[1, 2, 3],
    )


def vocab_map():
    gen = torch.Generator().manual_seed(7)
    keep = torch.sort(torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB]).values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[keep] = True
    return keep - torch.arange(DRAFT_VOCAB), t2d


def tiny_model(seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    d2t, t2d = vocab_map()
    model = Eagle3Drafter(tiny_config(), torch.randn(VOCAB, H), d2t, t2d)
    with torch.no_grad():  # norms away from 1 so that a misplaced norm shows
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    return model.eval()


def sample(length: int, seed: int) -> tuple:
    """(id, input_ids, loss_mask, teacher_argmax, aux, final) like ``Samples.get``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (length,), generator=gen)
    mask = (torch.arange(length) >= length // 3).to(torch.uint8)
    argmax = torch.cat([ids[1:], torch.randint(0, VOCAB, (1,), generator=gen)])
    argmax[::5] = torch.randint(0, VOCAB, (len(argmax[::5]),), generator=gen)  # not always the data
    return (
        f"s{seed}",
        ids,
        mask,
        argmax,
        torch.randn(length, 3 * H, generator=gen),
        torch.randn(length, H, generator=gen),
    )


def run_batch(model, pieces, rows=None):
    batch = make_batch(pieces, K, model.t2d)
    return batch, model(batch.aux, batch.step_ids, batch.positions, batch.segments, rows)


# -- the plain reference ---------------------------------------------------------------------


def reference_logits(model: Eagle3Drafter, piece) -> dict[tuple[int, int], torch.Tensor]:
    """{(row t, step k): logits} drafting one query at a time, as vLLM does."""
    _, ids, _, _, aux, _ = piece
    layer, attn, c = model.midlayer, model.midlayer.self_attn, model.config
    hf = LlamaConfig(
        hidden_size=H,
        num_attention_heads=c.num_attention_heads,
        head_dim=c.head_dim,
        rope_parameters=c.rope_parameters,
    )
    rope = LlamaRotaryEmbedding(hf)
    length = len(ids)

    def project(token, hidden, position):
        x = torch.cat([layer.input_layernorm(model.embed_tokens[token]), layer.hidden_norm(hidden)])
        q = attn.q_proj(x).view(1, c.num_attention_heads, 1, c.head_dim)  # [batch, heads, seq, D]
        k = attn.k_proj(x).view(1, c.num_key_value_heads, 1, c.head_dim)
        v = attn.v_proj(x).view(c.num_key_value_heads, c.head_dim)
        cos, sin = rope(x[None], torch.tensor([[position]]))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q[0, :, 0], k[0, :, 0], v

    def finish(hidden, q, keys, values):
        group = c.num_attention_heads // c.num_key_value_heads
        heads = []
        for h in range(c.num_attention_heads):
            kv = h // group
            scores = torch.stack([q[h] @ k[kv] for k in keys]) / c.head_dim**0.5
            weights = torch.softmax(scores, 0)
            heads.append(sum(w * v[kv] for w, v in zip(weights, values)))
        residual = hidden + attn.o_proj(torch.cat(heads))
        residual = residual + layer.mlp(layer.post_attention_layernorm(residual))
        return residual, model.lm_head(model.norm(residual))

    token = lambda i: ids[min(i, length - 1)]  # noqa: E731 (past the end: the last token)
    step0 = [project(token(t + 1), model.fc(aux[t]), t) for t in range(length)]
    out = {}
    for t in range(length):
        hidden = model.fc(aux[t])
        q, _, _ = step0[t]
        keys = [step0[j][1] for j in range(t + 1)]
        values = [step0[j][2] for j in range(t + 1)]
        hidden, out[t, 0] = finish(hidden, q, keys, values)
        for k in range(1, K):
            q, key, value = project(token(t + 1 + k), hidden, t + k)
            keys, values = keys + [key], values + [value]
            hidden, out[t, k] = finish(hidden, q, keys, values)
    return out


# -- tests -----------------------------------------------------------------------------------


def test_shapes_and_selected_rows():
    model = tiny_model()
    pieces = [sample(9, 1), sample(6, 2)]
    batch, logits = run_batch(model, pieces)
    assert batch.step_ids.shape == (K, 15) and len(logits) == K
    assert all(z.shape == (15, DRAFT_VOCAB) for z in logits)
    rows = [
        torch.tensor([0, 3, 14]),
        torch.tensor([], dtype=torch.long),
        torch.tensor([2]),
        torch.arange(15),
    ]
    _, picked = run_batch(model, pieces, rows)
    for z, full, r in zip(picked, logits, rows):
        assert z.shape == (len(r), DRAFT_VOCAB)
        torch.testing.assert_close(z, full[r])
    assert batch.positions.tolist() == list(range(9)) + list(range(6))
    assert batch.segments.tolist() == [0] * 9 + [1] * 6


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_batched_ttt_equals_drafting_one_query_at_a_time(attention):
    model = tiny_model()
    model.attention = attention
    pieces = [sample(7, 1), sample(5, 2)]
    with torch.no_grad():
        _, logits = run_batch(model, pieces)
        start = 0
        for piece in pieces:
            for (t, k), expected in reference_logits(model, piece).items():
                torch.testing.assert_close(logits[k][start + t], expected, rtol=1e-4, atol=1e-5)
            start += len(piece[1])


def test_packed_samples_never_attend_to_each_other():
    model = tiny_model()
    a, b, c = sample(8, 1), sample(6, 2), sample(7, 3)
    changed = sample(6, 9)  # another sample in b's place: ids, aux, everything
    with torch.no_grad():
        _, before = run_batch(model, [a, b, c])
        _, after = run_batch(model, [a, changed, c])
    for k in range(K):
        torch.testing.assert_close(before[k][:8], after[k][:8], rtol=0, atol=0)  # a, before b
        torch.testing.assert_close(before[k][14:], after[k][14:], rtol=0, atol=0)  # c, after b
        assert not torch.allclose(before[k][8:14], after[k][8:14])


def test_attention_split_into_blocks_of_whole_samples_changes_nothing(monkeypatch):
    model = tiny_model()
    pieces = [sample(7, 1), sample(5, 2), sample(9, 3), sample(3, 4)]
    batch = make_batch(pieces, K, model.t2d)
    spans = [(b.start, b.end) for b in drafter.attention_blocks(batch.segments, 8)]
    assert spans == [(0, 7), (7, 12), (12, 21), (21, 24)]
    with torch.no_grad():
        whole = model(batch.aux, batch.step_ids, batch.positions, batch.segments)
        split = drafter.attention_blocks
        monkeypatch.setattr(drafter, "attention_blocks", lambda segments, rows: split(segments, 8))
        blocked = model(batch.aux, batch.step_ids, batch.positions, batch.segments)
    for a, b in zip(whole, blocked):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("step", [0, 1, 2])
def test_step_sees_earlier_steps_of_its_row_and_nothing_of_later_rows(step):
    """Change the token row 4 embeds at ``step``: row 4 changes from that step on; at step 0
    (a shared KV entry) later rows change too; earlier rows and other rows' later steps never."""
    model = tiny_model()
    piece = sample(10, 1)
    with torch.no_grad():
        batch = make_batch([piece], K, model.t2d)
        base = model(batch.aux, batch.step_ids, batch.positions, batch.segments)
        ids = batch.step_ids.clone()
        ids[step, 4] = (ids[step, 4] + 1) % VOCAB
        new = model(batch.aux, ids, batch.positions, batch.segments)
    for k in range(K):
        same = torch.isclose(base[k], new[k], rtol=0, atol=0).all(-1)
        assert same[:4].all(), "an earlier row saw a later one"
        assert bool(same[4]) == (k < step), f"row 4 at step {k}"
        if step == 0:
            assert not same[5:].any(), "step-0 keys must be shared with later rows"
        else:
            assert same[5:].all(), "a step >= 1 entry leaked to other rows"


def test_aux_features_reach_later_rows_only_through_step_zero_keys():
    model = tiny_model()
    piece = sample(10, 1)
    with torch.no_grad():
        batch = make_batch([piece], K, model.t2d)
        base = model(batch.aux, batch.step_ids, batch.positions, batch.segments)
        aux = batch.aux.clone()
        aux[6] += 1.0
        new = model(aux, batch.step_ids, batch.positions, batch.segments)
    for k in range(K):
        same = torch.isclose(base[k], new[k], rtol=0, atol=0).all(-1)
        assert same[:6].all() and not same[6:].any()


def test_loss_and_metrics_match_a_plain_loop():
    model = tiny_model()
    pieces = [sample(9, 1), sample(4, 2), sample(12, 3)]
    teacher_head = torch.randn(DRAFT_VOCAB, H)
    d2t, t2d = model.d2t, model.t2d
    batch = make_batch(pieces, K, t2d)
    with torch.no_grad():
        ce, agree = batch_sums(model, batch, teacher_head)
    got = summarize(ce.double(), batch.counts(), agree, 0.8)

    ce_ref, n_ref, agree_ref = torch.zeros(K), torch.zeros(K), torch.zeros(K)
    for piece in pieces:
        _, ids, mask, argmax, _, final = piece
        with torch.no_grad():
            logits = reference_logits(model, piece)
        for t in range(len(ids)):
            for k in range(K):
                predicted = t + 2 + k  # the token this step drafts; the teacher is at t+1+k
                if predicted >= len(ids) or not mask[predicted] or not t2d[argmax[predicted - 1]]:
                    continue
                teacher = torch.softmax(final[predicted - 1] @ teacher_head.T, -1)
                ce_ref[k] += -(teacher * torch.log_softmax(logits[t, k], -1)).sum()
                draft = int(logits[t, k].argmax())
                agree_ref[k] += float(draft + int(d2t[draft]) == int(argmax[predicted - 1]))
                n_ref[k] += 1
    assert batch.counts().tolist() == n_ref.tolist() and n_ref.min() > 0
    torch.testing.assert_close(ce.float(), ce_ref, rtol=1e-4, atol=1e-4)
    assert agree.tolist() == agree_ref.tolist()
    loss = sum(0.8**k * ce_ref[k] / n_ref[k] for k in range(K))
    assert got["loss"] == pytest.approx(float(loss), rel=1e-4)
    acc = agree_ref / n_ref
    assert got["sim_al"] == pytest.approx(1 + sum(float(acc[: k + 1].prod()) for k in range(K)))


def test_agreement_maps_draft_ids_to_target_ids_with_d2t():
    model = tiny_model()
    piece = sample(6, 1)
    d2t = model.d2t
    assert (d2t != 0).any()
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[3, 0] = 1.0  # draft id 3 always wins
        model.norm.weight.fill_(1.0)
        model.midlayer.mlp.down_proj.weight.zero_()
        model.midlayer.self_attn.o_proj.weight.zero_()
        model.fc.weight.zero_()
        model.fc.weight[0, 0] = 1.0
    _, ids, mask, argmax, aux, final = piece
    aux = aux.clone()
    aux[:, 0] = 5.0
    target_id = 3 + int(d2t[3])
    assert target_id != 3
    hits = make_batch(
        [(piece[0], ids, torch.ones_like(mask), torch.full_like(argmax, target_id), aux, final)],
        K,
        model.t2d,
    )
    misses = make_batch(
        [(piece[0], ids, torch.ones_like(mask), torch.full_like(argmax, 3), aux, final)],
        K,
        torch.ones(VOCAB, dtype=torch.bool),
    )
    with torch.no_grad():
        _, agree = batch_sums(model, hits, torch.randn(DRAFT_VOCAB, H))
        assert agree.tolist() == hits.counts().tolist()
        _, agree = batch_sums(model, misses, torch.randn(DRAFT_VOCAB, H))
        assert agree.sum() == 0 and misses.counts().sum() > 0
    assert model.to_target_ids(torch.tensor([3])).item() == target_id


def test_export_writes_exactly_the_tensors_and_config_vllm_loads(tmp_path):
    model = tiny_model()
    config = export_drafter(model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written == config
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert (config["vocab_size"], config["draft_vocab_size"], config["target_hidden_size"]) == (
        VOCAB,
        DRAFT_VOCAB,
        H,
    )
    assert config["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        "use_aux_hidden_state": True,
    }
    assert config["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
        assert handle.get_tensor("t2d").dtype == torch.bool
        assert handle.get_tensor("d2t").dtype == torch.int64
    assert shapes == {
        "fc.weight": (H, 3 * H),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (32, 2 * H),
        "midlayer.self_attn.k_proj.weight": (16, 2 * H),
        "midlayer.self_attn.v_proj.weight": (16, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, 32),
        "midlayer.mlp.gate_proj.weight": (64, H),
        "midlayer.mlp.up_proj.weight": (64, H),
        "midlayer.mlp.down_proj.weight": (H, 64),
        "norm.weight": (H,),
        "lm_head.weight": (DRAFT_VOCAB, H),
        "d2t": (DRAFT_VOCAB,),
        "t2d": (VOCAB,),
    }


def test_exported_drafter_loads_back_with_the_target_embedding(tmp_path):
    from safetensors.torch import save_file

    model = tiny_model()
    export_drafter(model, tmp_path / "drafter")
    (tmp_path / "target").mkdir()
    save_file(
        {"model.embed_tokens.weight": model.embed_tokens}, tmp_path / "target" / "model.safetensors"
    )
    (tmp_path / "target" / "config.json").write_text("{}")
    loaded = load_drafter(tmp_path / "drafter", tmp_path / "target")
    pieces = [sample(7, 1), sample(5, 2)]
    with torch.no_grad():
        _, expected = run_batch(model, pieces)
        _, got = run_batch(loaded, pieces)
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_full_vocabulary_drafter_is_exported_without_d2t(tmp_path):
    """vLLM creates draft_id_to_target_id only for a reduced vocabulary; a d2t it has no
    parameter for fails the load."""
    plain = tiny_model()
    config = tiny_config()
    config.draft_vocab_size = VOCAB
    model = Eagle3Drafter(
        config,
        plain.embed_tokens,
        torch.zeros(VOCAB, dtype=torch.long),
        torch.ones(VOCAB, dtype=torch.bool),
    )
    export_drafter(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        assert "d2t" not in handle.keys() and "lm_head.weight" in handle.keys()
    with pytest.raises(RuntimeError, match="d2t all 0"):
        model.d2t[1] = 1
        export_drafter(model, tmp_path / "bad")


def llama3_inv_freq(theta, dim, factor, low_freq_factor, high_freq_factor, original_max):
    """Llama 3.1's RoPE scaling from its definition (Meta's reference `apply_scaling`), one
    frequency at a time: long wavelengths divided by ``factor``, short ones kept, and the band
    between interpolated smoothly."""
    low_freq_wavelen = original_max / low_freq_factor
    high_freq_wavelen = original_max / high_freq_factor
    out = []
    for i in range(0, dim, 2):
        freq = 1.0 / theta ** (i / dim)
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
        elif wavelen > low_freq_wavelen:
            out.append(freq / factor)
        else:
            smooth = (original_max / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(out)


def test_scaled_rope_of_the_target_is_used():
    plain = tiny_model()
    scaled = Eagle3Drafter(
        tiny_config(
            {
                "rope_theta": 500000.0,
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        ),
        plain.embed_tokens,
        plain.d2t,
        plain.t2d,
    )
    # head_dim 8: four frequencies, wavelengths 6.3, 167, 4443 and 118K against the band
    # [16/4, 16/1]: the first is interpolated, the others divided by 8
    expected = llama3_inv_freq(500000.0, 8, 8.0, 1.0, 4.0, 16)
    torch.testing.assert_close(scaled.inv_freq, expected, rtol=1e-6, atol=0)
    unscaled = torch.tensor([500000.0 ** (-i / 8) for i in (2, 4, 6)])
    torch.testing.assert_close(scaled.inv_freq[1:], unscaled / 8.0)
    assert not torch.allclose(scaled.inv_freq, plain.inv_freq)


def test_layer_init_makes_the_drafter_the_targets_last_layer_on_the_deepest_feature(tmp_path):
    """With the embedding half of q/k/v silenced, one row attends only to itself, so a
    drafter started from the target's last layer computes what transformers' own last layer,
    final norm and lm_head compute on the deepest aux feature."""
    from tests.tiny_llama import HIDDEN, LAYERS, make_tiny_llama
    from tests.tiny_llama import VOCAB as TARGET_VOCAB

    target = make_tiny_llama(tmp_path)
    config = DrafterConfig.from_target(target.config.to_dict(), TARGET_VOCAB, [1, 2, LAYERS - 2])
    model = Eagle3Drafter(
        config,
        target.model.embed_tokens.weight.detach(),
        torch.zeros(TARGET_VOCAB, dtype=torch.long),
        torch.ones(TARGET_VOCAB, dtype=torch.bool),
    )
    drafter_init.init_lm_head(model, target.lm_head.weight.detach())
    drafter_init.init_from_target_layer(model, load_target_layer(tmp_path, LAYERS - 1))
    with torch.no_grad():
        for proj in (
            model.midlayer.self_attn.q_proj,
            model.midlayer.self_attn.k_proj,
            model.midlayer.self_attn.v_proj,
        ):
            proj.weight[:, :HIDDEN] = 0
    aux = torch.randn(1, 3 * HIDDEN)
    [logits] = model(aux, torch.tensor([[5]]), torch.tensor([0]), torch.tensor([0]))
    with torch.no_grad():
        state = aux[:, -HIDDEN:][None]  # [1, 1, H]
        position = torch.tensor([[0]])
        rope = target.model.rotary_emb(state, position)
        out = target.model.layers[LAYERS - 1](
            state, position_embeddings=rope, position_ids=position
        )
        out = out[0] if isinstance(out, tuple) else out
        expected = target.lm_head(target.model.norm(out))[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_speculators_export_is_read_by_vllms_speculators_loader(tmp_path):
    """vLLM's own speculators reader (what `vllm serve DIR` runs) turns the exported config
    into the same drafter and speculative config; the plain export is left as it is."""
    base = pytest.importorskip("vllm.transformers_utils.configs.speculators.base")
    model = tiny_model()
    plain = export_drafter(model, tmp_path / "drafter")
    before = (tmp_path / "drafter" / "config.json").read_text()
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"]})
    )
    config = export_speculators(
        tmp_path / "drafter", tmp_path / "spec", str(tmp_path / "target"), 3
    )
    assert json.loads((tmp_path / "spec" / "config.json").read_text()) == config
    assert (tmp_path / "drafter" / "config.json").read_text() == before
    assert (tmp_path / "spec" / "model.safetensors").read_bytes() == (
        tmp_path / "drafter" / "model.safetensors"
    ).read_bytes()
    reader = base.SpeculatorsConfig
    assert reader.extract_vllm_speculative_config(json.loads(json.dumps(config))) == {
        "method": "eagle3",
        "num_speculative_tokens": 3,
    }
    layer = reader.extract_transformers_pre_trained_config(json.loads(json.dumps(config)))
    assert layer["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert layer["norm_before_residual"] is False  # vLLM's default there would be True
    assert layer["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert (layer["draft_vocab_size"], layer["target_hidden_size"]) == (DRAFT_VOCAB, H)
    shape_keys = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "rope_parameters",
    )
    assert {k: layer[k] for k in shape_keys} == {k: plain[k] for k in shape_keys}
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(tmp_path / "target")


# SGLang's EAGLE-3 loader (sgl-project/sglang python/sglang/srt/models/llama_eagle3.py, read at
# commit 03d5a77): the parameters of LlamaForCausalLMEagle3 (its module tree) and the renaming
# its load_weights applies. A name that matches no parameter is dropped without a word, so the
# exported names must land on exactly these parameters.
SGLANG_PARAMS = {
    "model.embed_tokens.weight",  # shared from the target when the draft has none
    "model.fc.weight",
    "model.norm.weight",
    "lm_head.weight",
    *(
        f"model.midlayer.{name}.weight"
        for name in (
            "input_layernorm",
            "hidden_norm",
            "post_attention_layernorm",
            "self_attn.qkv_proj",
            "self_attn.o_proj",
            "mlp.gate_up_proj",
            "mlp.down_proj",
        )
    ),
}
SGLANG_STACKED = [
    (".qkv_proj", ".q_proj"),
    (".qkv_proj", ".k_proj"),
    (".qkv_proj", ".v_proj"),
    (".gate_up_proj", ".gate_proj"),
    (".gate_up_proj", ".up_proj"),
]


def sglang_param_of(name: str) -> str | None:
    """Where SGLang's load_weights puts checkpoint tensor ``name`` (None: d2t/t2d, read apart)."""
    if "d2t" in name or "t2d" in name:
        return None
    for param, shard in SGLANG_STACKED:
        if shard in name:
            name = name.replace(shard, param)
            break
    return name if name in SGLANG_PARAMS else f"model.{name}"


def test_the_export_is_the_set_of_tensors_and_config_keys_sglang_loads(tmp_path):
    config = export_drafter(tiny_model(), tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert {"d2t", "t2d"} <= names  # d2t becomes SGLang's hot_token_id
    loaded = {sglang_param_of(n) for n in names} - {None}
    assert loaded <= SGLANG_PARAMS, sorted(loaded - SGLANG_PARAMS)  # nothing silently dropped
    assert SGLANG_PARAMS - loaded == {"model.embed_tokens.weight"}
    # the config keys its LlamaForCausalLMEagle3 and LlamaModel read
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]  # SGLang's EntryClass
    assert config["tie_word_embeddings"] is False  # True would make lm_head the embedding
    assert (
        config["draft_vocab_size"],
        config["target_hidden_size"],
        config["num_hidden_layers"],
    ) == (DRAFT_VOCAB, H, 1)  # [Vd, H] lm_head, fc from 3 x target H, no extra layers
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "hidden_act",
        "vocab_size",
        "rope_theta",
        "max_position_embeddings",
    ):
        assert key in config, key
    assert "bias" not in config  # SGLang builds fc without a bias unless told


# -- the attention kernels -------------------------------------------------------------------


def attention_reference(q, cache, segments, scale):
    """One query at a time over the explicit list of keys it sees: the step-0 keys of rows
    <= t of its sample, then its own keys of steps 1..k (cache as ``ttt_attention``'s)."""
    hkv, g, n, _ = q.shape
    rows = []
    for t in range(n):
        seen = [i for i in range(t + 1) if segments[i] == segments[t]]
        heads = []
        for h in range(hkv):
            keys = [cache[0][0][h, 0, i] for i in seen] + [k[h, 0, t] for k, _ in cache[1:]]
            values = [cache[0][1][h, 0, i] for i in seen] + [v[h, 0, t] for _, v in cache[1:]]
            keys, values = torch.stack(keys), torch.stack(values)
            heads.append(
                torch.stack(
                    [torch.softmax(keys @ q[h, j, t] * scale, 0) @ values for j in range(g)]
                )
            )
        rows.append(torch.stack(heads))
    return torch.stack(rows, 2)  # [Hkv, G, n, D]


def attention_inputs(n: int, steps: int, size: float = 1.0, seed: int = 0):
    """q [2, 3, n, 8] (GQA: 3 query heads per KV head) and a cache of 1 + steps entries."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(2, 3, n, 8, generator=gen) * size).requires_grad_()
    cache = [
        (
            torch.randn(2, 1, n, 8, generator=gen).requires_grad_(),
            torch.randn(2, 1, n, 8, generator=gen).requires_grad_(),
        )
        for _ in range(1 + steps)
    ]
    return q, cache


def outputs_and_gradients(fn, q, cache):
    out = fn(q, cache)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    leaves = [q] + [t for kv in cache for t in kv]
    return out.detach(), torch.autograd.grad((out * weights).sum(), leaves)


LAYOUTS = {"three samples": [0] * 4 + [1] * 3 + [2] * 5, "one sample": [0] * 12}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("steps", [0, 1, 2, 3])
def test_fused_attention_equals_eager_and_the_one_query_reference(layout, steps):
    """Outputs and gradients (queries, every key and value of every step) of the fused
    path equal the eager path's and the reference's, with packed samples and GQA."""
    segments = torch.tensor(LAYOUTS[layout])
    [block] = drafter.attention_blocks(segments)
    assert (block.mask is None) == (layout == "one sample")  # plain causal: no mask at all
    q, cache = attention_inputs(len(segments), steps, size=3.0)
    scale = 8**-0.5
    ref, ref_grads = outputs_and_gradients(
        lambda q, c: attention_reference(q, c, segments.tolist(), scale), q, cache
    )
    for fn in (
        lambda q, c: attention.ttt_attention(q, c, block.dense_mask(), scale),
        lambda q, c: attention.sdpa_ttt_attention(q, c, block, scale),
    ):
        out, grads = outputs_and_gradients(fn, q, cache)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        for got, expected in zip(grads, ref_grads):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_fused_attention_stays_exact_with_large_scores():
    """Scores in the hundreds: the sink's shift keeps every exponent in range."""
    segments = torch.tensor(LAYOUTS["three samples"])
    [block] = drafter.attention_blocks(segments)
    q, cache = attention_inputs(len(segments), 3, size=60.0, seed=3)
    with torch.no_grad():
        ref = attention_reference(q, cache, segments.tolist(), 8**-0.5)
        out = attention.sdpa_ttt_attention(q, cache, block, 8**-0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_a_fused_query_sees_no_other_sample_and_no_other_rows_later_steps():
    """Changing one sample's keys and values changes its own rows only; changing row 5's
    step-2 key changes row 5 only."""
    segments = torch.tensor(LAYOUTS["three samples"])
    [block] = drafter.attention_blocks(segments)
    q, cache = attention_inputs(len(segments), 2)
    with torch.no_grad():
        base = attention.sdpa_ttt_attention(q, cache, block, 0.3)
        other = [(k.clone(), v.clone()) for k, v in cache]
        for k, v in other:
            k[..., 4:7, :] += 1.0
            v[..., 4:7, :] -= 1.0
        changed = attention.sdpa_ttt_attention(q, other, block, 0.3)
        moved = (changed - base).abs().amax((0, 1, 3)) > 0  # per row
        assert moved.tolist() == [False] * 4 + [True] * 3 + [False] * 5
        other = [(k.clone(), v.clone()) for k, v in cache]
        other[2][0][..., 5, :] += 1.0
        changed = attention.sdpa_ttt_attention(q, other, block, 0.3)
        moved = (changed - base).abs().amax((0, 1, 3)) > 0
        assert moved.tolist() == [i == 5 for i in range(12)]


def test_the_fused_masks_encode_the_ttt_pattern():
    """The sink key 0 is seen by every query row; row r (batch row r - 1) sees the rows of
    its sample up to itself; flex attention's mask_mod says the same."""
    segments = torch.tensor([0, 0, 1, 1, 1])
    [block] = drafter.attention_blocks(segments)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 0, 0, 1, 0, 0],
            [1, 0, 0, 1, 1, 0],
            [1, 0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(block.sink_mask(), expected)
    assert torch.equal(block.mask, expected[1:, 1:])
    index = torch.arange(6)
    for sink, want in ((True, expected), (False, expected[1:, 1:])):
        size = len(want)
        mod = attention.ttt_mask_mod(segments, sink)
        got = mod(0, 0, index[:size, None], index[None, :size])
        assert torch.equal(got, want)


def test_flex_attention_forward_equals_the_reference_where_it_runs():
    """PyTorch's flex attention runs forward only on CPU (no backward): the block mask and
    the sink through it, against the reference."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    segments = torch.tensor(LAYOUTS["three samples"])
    [block] = drafter.attention_blocks(segments)
    for steps in (0, 2):
        q, cache = attention_inputs(len(segments), steps, size=3.0)
        q, cache = q.detach(), [(k.detach(), v.detach()) for k, v in cache]
        ref = attention_reference(q, cache, segments.tolist(), 0.3)
        out = attention.flex_ttt_attention(q, cache, block, 0.3)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_drafter_gradients_are_the_same_with_every_attention():
    """The whole TTT unroll, packed samples in one block: logits and every parameter's
    gradient, eager against sdpa."""
    model = tiny_model()
    pieces = [sample(7, 1), sample(5, 2), sample(9, 3)]
    got = {}
    for kind in ("eager", "sdpa"):
        model.attention = kind
        model.zero_grad()
        _, logits = run_batch(model, pieces)
        gen = torch.Generator().manual_seed(5)
        sum((z * torch.randn(z.shape, generator=gen)).sum() for z in logits).backward()
        got[kind] = (
            [z.detach() for z in logits],
            {n: p.grad.clone() for n, p in model.named_parameters()},
        )
    for a, b in zip(got["eager"][0], got["sdpa"][0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for name, grad in got["eager"][1].items():
        torch.testing.assert_close(got["sdpa"][1][name], grad, rtol=1e-4, atol=1e-5)


def test_attention_setting_is_checked():
    model = tiny_model()
    assert model.attention == "sdpa"  # the default: the fused kernel
    with pytest.raises(ValueError, match="none of"):
        model.attention = "fast"
    assert model_config.resolve_attention("auto", "cpu") == "sdpa"
    assert model_config.resolve_attention("eager", "cpu") == "eager"
    with pytest.raises(ValueError, match="CUDA"):
        model_config.resolve_attention("flex", "cpu")


def test_rope_keyed_by_layer_type_takes_the_full_attention_layers_base():
    """Gemma 3/4 key their RoPE by layer type, and Gemma 4's full-attention layers rotate a
    quarter of each head (``proportional``): the drafter, one full-attention layer, rotates
    its whole head by that base, the form vLLM's Llama layer and the trainer share."""
    target = {
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
            },
        }
    }
    assert rope_parameters(target) == {"rope_type": "default", "rope_theta": 1000000.0}
    partial = {
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5}
    }
    assert rope_parameters(partial) == {"rope_type": "default", "rope_theta": 5e5}
    scaled = {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4.0}}
    assert rope_parameters(scaled) == {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}
