"""The hidden-state shard format: encode/load round trips per storage dtype, the fp8 error
bound, the self-describing header, and the byte accounting extraction plans disk with."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from eaglet import shards

AUX_IDS = [2, 3, 5]
TARGET = {"spec": "local", "path": "/models/tiny", "config_sha256": "abc"}


def packed(lengths, hidden, seed=0, vocab=300):
    """A synthetic shard's tensors for samples of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    n_tok = sum(lengths)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    input_ids = torch.randint(0, vocab, (n_tok,), generator=g)
    loss_mask = torch.zeros(n_tok, dtype=torch.uint8)
    for s, length in enumerate(lengths):  # the second half of every sample is "completion"
        loss_mask[int(offsets[s]) + length // 2:int(offsets[s + 1])] = 1
    teacher_argmax = torch.randint(0, vocab, (n_tok,), generator=g)
    aux = torch.randn(n_tok, 3 * hidden, generator=g)
    final = torch.randn(n_tok, hidden, generator=g)
    return input_ids, loss_mask, offsets, teacher_argmax, aux, final


def write(tmp_path, tensors, dtype, name="shard_00000.safetensors", sample_ids=None,
          aux_ids=AUX_IDS, target=TARGET):
    offsets = tensors[2]
    if sample_ids is None:
        sample_ids = [f"p-{i:04d}" for i in range(len(offsets) - 1)]
    data = shards.encode(*tensors, sample_ids=sample_ids, aux_layer_ids=aux_ids, dtype=dtype,
                         target=target)
    path = tmp_path / name
    path.write_bytes(data)
    return path, data


def tensor_bytes(data: bytes) -> int:
    """Bytes of the tensor payload of a safetensors blob (after its 8-byte length and header)."""
    header_len = struct.unpack("<Q", data[:8])[0]
    return len(data) - 8 - header_len


# -- round trips -----------------------------------------------------------------------------

def test_float32_round_trip_is_exact(tmp_path):
    tensors = packed([5, 9, 1, 12], hidden=16)
    path, _ = write(tmp_path, tensors, "float32")
    shard = shards.load(path)
    input_ids, loss_mask, offsets, teacher_argmax, aux, final = tensors
    assert torch.equal(shard.input_ids, input_ids) and shard.input_ids.dtype == torch.int64
    assert torch.equal(shard.loss_mask, loss_mask) and shard.loss_mask.dtype == torch.uint8
    assert torch.equal(shard.offsets, offsets)
    assert torch.equal(shard.teacher_argmax, teacher_argmax)
    assert torch.equal(shard.aux_hidden, aux) and shard.aux_hidden.dtype == torch.float32
    assert torch.equal(shard.final_hidden, final)
    assert shard.num_samples == 4 and shard.num_tokens == 27


@pytest.mark.parametrize("dtype, eps", [("bfloat16", 2.0 ** -8), ("float16", 2.0 ** -11)])
def test_half_precision_round_trip_within_rounding(tmp_path, dtype, eps):
    tensors = packed([7, 3, 10], hidden=32, seed=1)
    path, _ = write(tmp_path, tensors, dtype)
    shard = shards.load(path)
    aux, final = tensors[4], tensors[5]
    assert shard.aux_hidden.dtype == torch.float32  # dequantized to float32 on load
    # round to nearest: relative error at most half an ulp (2**-8 for bf16's 8-bit mantissa)
    for got, want in ((shard.aux_hidden, aux), (shard.final_hidden, final)):
        assert ((got - want).abs() <= eps * want.abs() + 1e-30).all()
        assert torch.equal(got, want.to(shards.STORAGE_DTYPES[dtype]).float())
    with pytest.raises(AssertionError):  # it really was stored in the narrow dtype
        assert torch.equal(shard.aux_hidden, aux)


def test_unknown_dtype_raises():
    with pytest.raises(ValueError, match="unknown shard dtype 'int8'"):
        shards.encode(*packed([3], hidden=4), sample_ids=["a"], aux_layer_ids=AUX_IDS,
                      dtype="int8", target=TARGET)


# -- fp8 -------------------------------------------------------------------------------------

E4M3_REL = 2.0 ** -4    # 3 mantissa bits: round to nearest is within 2**-4 of a normal value
E4M3_SUB = 2.0 ** -10   # half the subnormal spacing (2**-9) of e4m3, in scaled units


def wide_range(n, width, seed):
    """Values spanning many binades, with zeros, outliers and sign changes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g) * torch.exp2(torch.randint(-20, 8, (n, width), generator=g).float())
    x[0] = 0.0                            # an all-zero token
    x[1, 5] = 1e4                         # an outlier dwarfs the rest of its group
    x[2] = torch.linspace(-3, 3, width)
    x[3] *= 1e-6                          # a small token: its scale follows it
    x[4] *= 1e-30                         # below the scale's 1e-12 floor: flushed to zero
    return x


@pytest.mark.parametrize("groups", [1, 3])
def test_fp8_error_bound(groups):
    x = wide_range(64, 3 * 48, seed=groups)
    q, scale = shards.quantize_fp8(x, groups)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scale.shape == (64, groups) and scale.dtype == torch.float32
    assert torch.isfinite(q.float()).all()
    deq = shards.dequantize_fp8(q, scale)
    err = (deq - x).abs()
    per_group_scale = scale.repeat_interleave(x.shape[1] // groups, dim=1)
    # element-wise: relative 2**-4 for normals, absolute half-spacing for subnormals
    # (plus float32 rounding of the scale division/multiplication)
    bound = E4M3_REL * x.abs() + E4M3_SUB * per_group_scale
    assert (err <= bound * (1 + 1e-5) + 1e-30).all()
    # relative to the group's largest magnitude: never worse than 2**-4 of it (tokens above
    # the 1e-12 floor of the scale; below it everything is flushed, off by at most 1e-12)
    group_max = x.reshape(64, groups, -1).abs().amax(-1).repeat_interleave(x.shape[1] // groups, dim=1)
    normal = group_max >= 1e-12
    assert (err[normal] <= E4M3_REL * group_max[normal] * (1 + 1e-5)).all()
    assert (err[~normal] <= 1e-12).all() and (~normal[4]).all()
    # a token a million times smaller keeps the same relative precision (per-token scale)
    assert ((err[3] / x[3].abs().amax()) <= E4M3_REL).all()
    # the group maximum itself is exactly representable (it maps to 448)
    assert torch.equal(deq[0], torch.zeros_like(deq[0]))
    assert deq[1, 5] == pytest.approx(1e4, rel=1e-6)


def test_fp8_groups_are_per_aux_layer():
    """One loud layer must not crush the resolution of a quiet one."""
    g = torch.Generator().manual_seed(7)
    hidden = 32
    aux = torch.cat([torch.randn(20, hidden, generator=g) * 1000,
                     torch.randn(20, hidden, generator=g) * 0.01,
                     torch.randn(20, hidden, generator=g)], dim=1)
    q, scale = shards.quantize_fp8(aux, 3)
    deq = shards.dequantize_fp8(q, scale)
    quiet = slice(hidden, 2 * hidden)
    rel = ((deq[:, quiet] - aux[:, quiet]).abs() / aux[:, quiet].abs().amax(-1, keepdim=True)).max()
    assert rel <= E4M3_REL
    # one scale for all three layers would have flushed the quiet layer to (almost) zero
    q1, s1 = shards.quantize_fp8(aux, 1)
    rel1 = ((shards.dequantize_fp8(q1, s1)[:, quiet] - aux[:, quiet]).abs()
            / aux[:, quiet].abs().amax(-1, keepdim=True)).max()
    assert rel1 > 0.2


def test_fp8_shard_round_trip(tmp_path):
    tensors = packed([6, 11, 4], hidden=24, seed=3)
    path, data = write(tmp_path, tensors, "fp8")
    shard = shards.load(path)
    aux, final = tensors[4], tensors[5]
    assert shard.dtype == "fp8"
    assert shard.aux_hidden.dtype == torch.float32 and shard.aux_hidden.shape == aux.shape
    assert shard.final_hidden.shape == final.shape
    for got, want, groups in ((shard.aux_hidden, aux, 3), (shard.final_hidden, final, 1)):
        group_max = want.reshape(len(want), groups, -1).abs().amax(-1)
        group_max = group_max.repeat_interleave(want.shape[1] // groups, dim=1)
        assert ((got - want).abs() <= E4M3_REL * group_max * (1 + 1e-5)).all()
        assert torch.equal(got, shards.dequantize_fp8(*shards.quantize_fp8(want, groups)))
    assert torch.equal(shard.input_ids, tensors[0])
    assert torch.equal(shard.teacher_argmax, tensors[3])

    with safe_open(str(path), framework="pt") as handle:
        assert set(handle.keys()) == {"input_ids", "loss_mask", "offsets", "teacher_argmax",
                                      "aux_hidden", "aux_scale", "final_hidden", "final_scale"}
        assert handle.get_slice("aux_hidden").get_dtype() == "F8_E4M3"
        assert handle.get_tensor("aux_scale").shape == (21, 3)
        assert handle.get_tensor("final_scale").shape == (21, 1)


# -- header ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8"])
def test_metadata_round_trip(tmp_path, dtype):
    ids = ["p-a", "p-ü", "p-x/y"]
    target = {"spec": "org/model", "hub_id": "org/model", "config_sha256": "f" * 64}
    path, _ = write(tmp_path, packed([2, 3, 4], hidden=8), dtype, sample_ids=ids,
                    aux_ids=[0, 4, 7], target=target)
    meta = shards.read_metadata(path)
    assert meta == {"dtype": dtype, "hidden_size": 8, "aux_layer_ids": [0, 4, 7],
                    "sample_ids": ids, "target": target}
    shard = shards.load(path)
    assert shard.sample_ids == ids and shard.aux_layer_ids == [0, 4, 7]
    assert shard.dtype == dtype and shard.target == target

    with safe_open(str(path), framework="pt") as handle:  # readable without eaglet
        raw = handle.metadata()
    assert raw["format"] == shards.FORMAT and json.loads(raw["sample_ids"]) == ids


def test_offsets_and_sample_slicing(tmp_path):
    lengths = [4, 1, 7, 3]
    tensors = packed(lengths, hidden=8, seed=5)
    path, _ = write(tmp_path, tensors, "float32")
    shard = shards.load(path)
    assert shard.offsets.tolist() == [0, 4, 5, 12, 15]
    start = 0
    for s, length in enumerate(lengths):
        rows = shard.sample(s)
        assert rows == slice(start, start + length)
        assert torch.equal(shard.input_ids[rows], tensors[0][start:start + length])
        assert torch.equal(shard.aux_hidden[rows], tensors[4][start:start + length])
        assert shard.loss_mask[rows].tolist() == [0] * (length // 2) + [1] * (length - length // 2)
        start += length
    with pytest.raises(IndexError):
        shard.sample(len(lengths))


def test_read_metadata_rejects_foreign_safetensors(tmp_path):
    plain = tmp_path / "model.safetensors"
    plain.write_bytes(save({"w": torch.zeros(2, 2)}))
    with pytest.raises(ValueError, match="not an eaglet hidden-state shard"):
        shards.read_metadata(plain)
    other = tmp_path / "other.safetensors"
    other.write_bytes(save({"w": torch.zeros(2)}, metadata={"format": "pt"}))
    with pytest.raises(ValueError, match="'pt'"):
        shards.read_metadata(other)
    with pytest.raises(ValueError):
        shards.load(other)


# -- byte accounting -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "fp8"])
def test_bytes_per_token_is_the_exact_tensor_payload(dtype):
    lengths = [37] * 20 + [13] * 7
    hidden = 64
    tensors = packed(lengths, hidden=hidden, seed=11)
    data = shards.encode(*tensors, sample_ids=[f"p-{i}" for i in range(len(lengths))],
                         aux_layer_ids=AUX_IDS, dtype=dtype, target=TARGET)
    n_tok, n_seq = sum(lengths), len(lengths)
    # everything but offsets (8 bytes per sample + 8) scales with the token count
    assert tensor_bytes(data) == n_tok * shards.bytes_per_token(hidden, 3, dtype) + 8 * (n_seq + 1)


def test_bytes_per_token_predicts_the_file_size():
    """bf16 at H=576 (the embedded target), N=2000: header and offsets are noise."""
    lengths = [100] * 20
    hidden = 576
    tensors = packed(lengths, hidden=hidden, seed=2)
    data = shards.encode(*tensors, sample_ids=[f"p-{i:06d}" for i in range(20)],
                         aux_layer_ids=[2, 15, 27], dtype="bfloat16", target=TARGET)
    planned = 2000 * shards.bytes_per_token(hidden, 3, "bfloat16")
    assert shards.bytes_per_token(hidden, 3, "bfloat16") == 17 + 4 * hidden * 2
    assert 1.0 <= len(data) / planned <= 1.02
    fp8 = shards.bytes_per_token(hidden, 3, "fp8")
    assert fp8 == 17 + 4 * hidden + 16
    assert 0.5 < fp8 / shards.bytes_per_token(hidden, 3, "bfloat16") < 0.52


def test_sha256_helpers_agree(tmp_path):
    path, data = write(tmp_path, packed([3, 3], hidden=4), "bfloat16")
    assert shards.sha256_path(path) == shards.sha256_bytes(data)
    assert len(shards.sha256_bytes(data)) == 64


def test_shard_path_naming(tmp_path):
    assert shards.shard_path(tmp_path, 7) == tmp_path / "shard_00007.safetensors"
    assert shards.shard_path(str(tmp_path), 12345).name == "shard_12345.safetensors"
