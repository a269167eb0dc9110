"""The hidden-state shard format: write/load round trips per storage dtype, the fp8 error
bound, the self-describing header, the streaming writer (its hash, its bytes, its memory),
and the byte accounting extraction plans disk with."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from eaglet.data import shards

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
        loss_mask[int(offsets[s]) + length // 2 : int(offsets[s + 1])] = 1
    teacher_argmax = torch.randint(0, vocab, (n_tok,), generator=g)
    aux = torch.randn(n_tok, 3 * hidden, generator=g)
    final = torch.randn(n_tok, hidden, generator=g)
    return input_ids, loss_mask, offsets, teacher_argmax, aux, final


def write(
    tmp_path,
    tensors,
    dtype,
    name="shard_00000.safetensors",
    sample_ids=None,
    aux_ids=AUX_IDS,
    target=TARGET,
):
    offsets = tensors[2]
    if sample_ids is None:
        sample_ids = [f"p-{i:04d}" for i in range(len(offsets) - 1)]
    path = tmp_path / name
    shards.write(
        path, *tensors, sample_ids=sample_ids, aux_layer_ids=aux_ids, dtype=dtype, target=target
    )
    return path, path.read_bytes()


def reference_digest(data: bytes) -> str:
    """The block digest by its definition: sha256 over the sha256s of the 8 MiB blocks."""
    block = 8 << 20
    digests = b"".join(
        hashlib.sha256(data[i : i + block]).digest() for i in range(0, len(data), block)
    )
    return "sha256-8MiB-blocks:" + hashlib.sha256(digests).hexdigest()


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


@pytest.mark.parametrize("dtype, eps", [("bfloat16", 2.0**-8), ("float16", 2.0**-11)])
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


def test_unknown_dtype_raises(tmp_path):
    with pytest.raises(ValueError, match="unknown shard dtype 'int8'"):
        shards.write(
            tmp_path / "x.safetensors",
            *packed([3], hidden=4),
            sample_ids=["a"],
            aux_layer_ids=AUX_IDS,
            dtype="int8",
            target=TARGET,
        )
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary file


# -- fp8 -------------------------------------------------------------------------------------

E4M3_REL = 2.0**-4  # 3 mantissa bits: round to nearest is within 2**-4 of a normal value
E4M3_SUB = 2.0**-10  # half the subnormal spacing (2**-9) of e4m3, in scaled units


def wide_range(n, width, seed):
    """Values spanning many binades, with zeros, outliers and sign changes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g) * torch.exp2(
        torch.randint(-20, 8, (n, width), generator=g).float()
    )
    x[0] = 0.0  # an all-zero token
    x[1, 5] = 1e4  # an outlier dwarfs the rest of its group
    x[2] = torch.linspace(-3, 3, width)
    x[3] *= 1e-6  # a small token: its scale follows it
    x[4] *= 1e-30  # below the scale's 1e-12 floor: flushed to zero
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
    group_max = (
        x.reshape(64, groups, -1).abs().amax(-1).repeat_interleave(x.shape[1] // groups, dim=1)
    )
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
    aux = torch.cat(
        [
            torch.randn(20, hidden, generator=g) * 1000,
            torch.randn(20, hidden, generator=g) * 0.01,
            torch.randn(20, hidden, generator=g),
        ],
        dim=1,
    )
    q, scale = shards.quantize_fp8(aux, 3)
    deq = shards.dequantize_fp8(q, scale)
    quiet = slice(hidden, 2 * hidden)
    rel = ((deq[:, quiet] - aux[:, quiet]).abs() / aux[:, quiet].abs().amax(-1, keepdim=True)).max()
    assert rel <= E4M3_REL
    # one scale for all three layers would have flushed the quiet layer to (almost) zero
    q1, s1 = shards.quantize_fp8(aux, 1)
    rel1 = (
        (shards.dequantize_fp8(q1, s1)[:, quiet] - aux[:, quiet]).abs()
        / aux[:, quiet].abs().amax(-1, keepdim=True)
    ).max()
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
        assert set(handle.keys()) == {
            "input_ids",
            "loss_mask",
            "offsets",
            "teacher_argmax",
            "aux_hidden",
            "aux_scale",
            "final_hidden",
            "final_scale",
        }
        assert handle.get_slice("aux_hidden").get_dtype() == "F8_E4M3"
        assert handle.get_tensor("aux_scale").shape == (21, 3)
        assert handle.get_tensor("final_scale").shape == (21, 1)


# -- header ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8"])
def test_metadata_round_trip(tmp_path, dtype):
    ids = ["p-a", "p-ü", "p-x/y"]
    target = {"spec": "org/model", "hub_id": "org/model", "config_sha256": "f" * 64}
    path, _ = write(
        tmp_path,
        packed([2, 3, 4], hidden=8),
        dtype,
        sample_ids=ids,
        aux_ids=[0, 4, 7],
        target=target,
    )
    meta = shards.read_metadata(path)
    assert meta == {
        "dtype": dtype,
        "hidden_size": 8,
        "aux_layer_ids": [0, 4, 7],
        "sample_ids": ids,
        "target": target,
    }
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
        assert torch.equal(shard.input_ids[rows], tensors[0][start : start + length])
        assert torch.equal(shard.aux_hidden[rows], tensors[4][start : start + length])
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
def test_bytes_per_token_is_the_exact_tensor_payload(tmp_path, dtype):
    lengths = [37] * 20 + [13] * 7
    hidden = 64
    tensors = packed(lengths, hidden=hidden, seed=11)
    _, data = write(tmp_path, tensors, dtype, sample_ids=[f"p-{i}" for i in range(len(lengths))])
    n_tok, n_seq = sum(lengths), len(lengths)
    # everything but offsets (8 bytes per sample + 8) scales with the token count
    assert tensor_bytes(data) == n_tok * shards.bytes_per_token(hidden, 3, dtype) + 8 * (n_seq + 1)


def test_bytes_per_token_predicts_the_file_size(tmp_path):
    """bf16 at H=576 (the embedded target), N=2000: header and offsets are noise."""
    lengths = [100] * 20
    hidden = 576
    tensors = packed(lengths, hidden=hidden, seed=2)
    _, data = write(
        tmp_path,
        tensors,
        "bfloat16",
        sample_ids=[f"p-{i:06d}" for i in range(20)],
        aux_ids=[2, 15, 27],
    )
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


# -- the streaming writer --------------------------------------------------------------------


def reference_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with per-token, per-group scales, computed in float32 throughout (the definition
    the writer's blockwise, dtype-preserving arithmetic must reproduce bit for bit)."""
    n, width = x.shape
    grouped = x.float().reshape(n, groups, width // groups)
    scale = grouped.abs().amax(dim=-1).clamp(min=1e-12) / shards.FP8_MAX
    return (grouped / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(n, width), scale


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_quantization_is_the_float32_definition(source):
    x = wide_range(64, 3 * 48, seed=4).clamp(-6e4, 6e4).to(source)
    x[5, 7] = float("nan")
    x[6, 0] = float("inf")
    for groups in (1, 3):
        q, scale = shards.quantize_fp8(x, groups)
        want_q, want_scale = reference_fp8(x, groups)
        assert same_bits(scale, want_scale) and same_bits(q, want_q)


def reference_bytes(tensors, dtype, sample_ids, aux_ids=AUX_IDS, target=TARGET) -> bytes:
    """A shard as ``safetensors.torch.save`` encodes it in memory, with the ``__metadata__``
    keys sorted: how shards were written before the streaming writer, kept here as the
    reference it must reproduce byte for byte."""
    input_ids, loss_mask, offsets, teacher_argmax, aux, final = tensors
    out = {
        "input_ids": input_ids.to(torch.int64),
        "loss_mask": loss_mask.to(torch.uint8),
        "offsets": offsets.to(torch.int64),
        "teacher_argmax": teacher_argmax.to(torch.int64),
    }
    if dtype == "fp8":
        out["aux_hidden"], out["aux_scale"] = reference_fp8(aux, len(aux_ids))
        out["final_hidden"], out["final_scale"] = reference_fp8(final, 1)
    else:
        out["aux_hidden"] = aux.to(shards.STORAGE_DTYPES[dtype]).contiguous()
        out["final_hidden"] = final.to(shards.STORAGE_DTYPES[dtype]).contiguous()
    metadata = {
        "format": shards.FORMAT,
        "dtype": dtype,
        "hidden_size": str(final.shape[1]),
        "aux_layer_ids": json.dumps(list(aux_ids)),
        "sample_ids": json.dumps(sample_ids),
        "target": json.dumps(target, sort_keys=True),
    }
    data = save(out, metadata=metadata)
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    return data[:8] + text.ljust(n, b" ") + data[8 + n :]


def stored(tensors, dtype, aux_ids=AUX_IDS) -> dict:
    """The tensors a shard must hold for ``tensors`` in storage ``dtype``."""
    input_ids, loss_mask, offsets, teacher_argmax, aux, final = tensors
    out = {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "offsets": offsets,
        "teacher_argmax": teacher_argmax,
    }
    if dtype == "fp8":
        out["aux_hidden"], out["aux_scale"] = shards.quantize_fp8(aux, len(aux_ids))
        out["final_hidden"], out["final_scale"] = shards.quantize_fp8(final, 1)
    else:
        out["aux_hidden"] = aux.to(shards.STORAGE_DTYPES[dtype])
        out["final_hidden"] = final.to(shards.STORAGE_DTYPES[dtype])
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


DTYPES = ["float32", "bfloat16", "float16", "fp8"]
ODD_IDS = ["p-ü", 'p-"quoted"', "p-x/y\\z", "p-\u4e2d\u6587", "p-tab\t"]


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_writer_returns_the_file_hash_and_size(tmp_path, dtype, source):
    tensors = list(packed([9, 4, 17, 1, 6], hidden=24, seed=21))
    tensors[4], tensors[5] = tensors[4].to(source), tensors[5].to(source)
    path = tmp_path / "shard.safetensors"
    written = shards.write(
        path,
        *tensors,
        sample_ids=ODD_IDS,
        aux_layer_ids=AUX_IDS,
        dtype=dtype,
        target=TARGET,
        chunk_bytes=256,
    )  # many row blocks
    data = path.read_bytes()
    assert written.sha256 == reference_digest(data) == shards.digest_path(path)
    assert written.bytes == len(data)
    assert [p.name for p in tmp_path.iterdir()] == ["shard.safetensors"]  # no temporary left


@pytest.mark.parametrize("dtype", DTYPES)
def test_written_shard_holds_what_was_passed(tmp_path, dtype):
    tensors = packed([5, 12, 3, 8], hidden=16, seed=22)
    path = tmp_path / "shard.safetensors"
    written = shards.write(
        path,
        *tensors,
        sample_ids=ODD_IDS[:4],
        aux_layer_ids=AUX_IDS,
        dtype=dtype,
        target=TARGET,
        chunk_bytes=300,
    )
    want = stored(tensors, dtype)
    with safe_open(str(path), framework="pt") as handle:  # readable by safetensors itself
        assert set(handle.keys()) == set(want)
        for name, tensor in want.items():
            assert same_bits(handle.get_tensor(name), tensor), name
        assert json.loads(handle.metadata()["sample_ids"]) == ODD_IDS[:4]
    for shard in (shards.load(path), shards.load(path, sha256=written.sha256)):
        assert shard.sample_ids == ODD_IDS[:4] and shard.dtype == dtype
        assert torch.equal(shard.input_ids, tensors[0])
        assert torch.equal(shard.loss_mask, tensors[1])
        assert torch.equal(shard.offsets, tensors[2])
        assert torch.equal(shard.teacher_argmax, tensors[3])
        if dtype == "fp8":
            aux = shards.dequantize_fp8(want["aux_hidden"], want["aux_scale"])
            final = shards.dequantize_fp8(want["final_hidden"], want["final_scale"])
        else:
            aux, final = want["aux_hidden"].float(), want["final_hidden"].float()
        assert torch.equal(shard.aux_hidden, aux) and torch.equal(shard.final_hidden, final)


@pytest.mark.parametrize("chunk_bytes", [1, 500, shards.CHUNK_BYTES])
@pytest.mark.parametrize("dtype", DTYPES)
def test_writer_bytes_equal_safetensors_save(tmp_path, dtype, chunk_bytes):
    """The streamed file is byte for byte the file ``save`` + the sorted metadata gave (the
    former write path), whatever the row blocks, and with the aux states given as one tensor
    or as per-sample row pieces (extraction passes its per-sequence states unconcatenated)."""
    lengths = [7, 1, 13, 4]
    tensors = list(packed(lengths, hidden=8, seed=23))
    tensors[5] = tensors[5].to(torch.bfloat16)  # states come in the target's dtype too
    want = reference_bytes(tensors, dtype, ODD_IDS[:4])
    pieces = list(tensors[4].split(lengths))
    for aux in (tensors[4], pieces):
        path = tmp_path / "shard.safetensors"
        written = shards.write(
            path,
            *tensors[:4],
            aux,
            tensors[5],
            sample_ids=ODD_IDS[:4],
            aux_layer_ids=AUX_IDS,
            dtype=dtype,
            target=TARGET,
            chunk_bytes=chunk_bytes,
        )
        assert path.read_bytes() == want
        assert written.sha256 == reference_digest(want)


def test_writer_rejects_mismatched_row_pieces(tmp_path):
    tensors = packed([3, 4], hidden=8)
    with pytest.raises(ValueError, match="aux_hidden"):
        shards.write(
            tmp_path / "x.safetensors",
            *tensors[:4],
            [tensors[4][:3], tensors[4][3:, :8]],
            tensors[5],
            sample_ids=["a", "b"],
            aux_layer_ids=AUX_IDS,
            dtype="bfloat16",
            target=TARGET,
        )
    assert list(tmp_path.iterdir()) == []


MEMORY_PROBE = textwrap.dedent("""
    import resource, sys, torch
    from eaglet.data import shards

    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    n, hidden = 40_000, 640
    g = torch.Generator().manual_seed(0)
    aux = torch.empty(n, 3 * hidden, dtype=torch.bfloat16).normal_(generator=g)
    final = torch.empty(n, hidden, dtype=torch.bfloat16).normal_(generator=g)
    ids = torch.randint(0, 1000, (n,), generator=g)
    mask = torch.ones(n, dtype=torch.uint8)
    offsets = torch.arange(0, n + 1, 500)
    argmax = torch.full((n,), -1)
    sample_ids = [f"p-{i}" for i in range(len(offsets) - 1)]
    base = peak()
    for dtype, name in (("bfloat16", "a"), ("fp8", "b")):
        shards.write(f"{sys.argv[1]}/{name}.safetensors", ids, mask, offsets, argmax, aux, final,
                     sample_ids=sample_ids, aux_layer_ids=[1, 2, 3], dtype=dtype,
                     target={"spec": "x"})
    print(peak() - base, aux.nbytes + final.nbytes)
""")


@pytest.mark.subprocess
def test_writer_memory_stays_bounded(tmp_path):
    """Writing a ~200 MB shard (bf16, then fp8 from the same bf16 states) raises the process's
    peak resident memory by far less than the shard: a few row blocks, not a copy of it.
    Measured in a fresh interpreter so that nothing else this test session did counts."""
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    extra, shard_bytes = map(int, out.split())
    assert shard_bytes > 190e6
    assert extra < shard_bytes / 4, f"writing raised the peak RSS by {extra / 1e6:.0f} MB"


# -- mapped reading --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "fp8"])
def test_mapped_shard_converts_to_what_the_eager_load_gives(tmp_path, dtype):
    """open_mapped keeps the stored dtype (views of the file) and to_float, applied to any
    rows, gives the very float32 values load gives for those rows."""
    lengths = [5, 9, 1, 12]
    path, _ = write(tmp_path, packed(lengths, hidden=16, seed=4), dtype)
    written = shards.digest_path(path)
    eager, mapped = shards.load(path, written), shards.open_mapped(path, written)
    stored = shards.STORAGE_DTYPES[dtype]
    assert mapped.aux_hidden.dtype == mapped.final_hidden.dtype == stored
    assert (mapped.aux_scale is not None) == (dtype == "fp8") == (mapped.final_scale is not None)
    for name in ("input_ids", "loss_mask", "offsets", "teacher_argmax"):
        got, want = getattr(mapped, name), getattr(eager, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert (mapped.sample_ids, mapped.aux_layer_ids, mapped.dtype, mapped.target) == (
        eager.sample_ids,
        eager.aux_layer_ids,
        eager.dtype,
        eager.target,
    )
    for s in range(len(lengths)):
        rows = mapped.sample(s)
        scales = (
            (None, None) if dtype != "fp8" else (mapped.aux_scale[rows], mapped.final_scale[rows])
        )
        assert torch.equal(
            shards.to_float(mapped.aux_hidden[rows], scales[0]), eager.aux_hidden[rows]
        )
        assert torch.equal(
            shards.to_float(mapped.final_hidden[rows], scales[1]), eager.final_hidden[rows]
        )
    # the tensors are the file's pages: nothing was copied, and giving them back loses nothing
    assert mapped.aux_hidden.untyped_storage().nbytes() == path.stat().st_size
    before = mapped.aux_hidden[:3].clone()
    mapped.mapping.release()
    assert torch.equal(mapped.aux_hidden[:3], before)


def test_mapped_shard_writes_stay_in_the_process(tmp_path):
    path, data = write(tmp_path, packed([4, 4], hidden=8), "bfloat16")
    mapped = shards.open_mapped(path)
    mapped.aux_hidden[0] = 7.0  # copy-on-write: no fault, and the file keeps its bytes
    assert path.read_bytes() == data


@pytest.mark.parametrize("scheme", ["blocks", "plain sha256 of an earlier eaglet"])
@pytest.mark.parametrize("damage", ["bit flip", "truncated", "truncated header"])
def test_mapped_shard_refuses_damaged_bytes_by_name(tmp_path, damage, scheme):
    path, data = write(tmp_path, packed([6, 7, 8], hidden=16, seed=9), "bfloat16")
    recorded = reference_digest(data) if scheme == "blocks" else hashlib.sha256(data).hexdigest()
    assert shards.open_mapped(path, recorded).num_samples == 3  # whole: accepted
    if damage == "bit flip":
        broken = bytearray(data)
        broken[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(broken))
    else:
        path.write_bytes(data[:100] if damage == "truncated header" else data[:-64])
    with pytest.raises(shards.ShardDamaged, match=rf"{path} is damaged: its sha256 .* recorded"):
        shards.open_mapped(path, recorded)
    if damage != "bit flip":  # without the hash, the file's own structure gives it away
        with pytest.raises(shards.ShardDamaged, match=rf"{path} is damaged: it cannot be read"):
            shards.open_mapped(path)


# -- the file written in any order -----------------------------------------------------------


def shard_file_fields(rows: int, width: int) -> list:
    return [
        shards.Field("a", torch.bfloat16, (rows, width)),
        shards.Field("b", torch.int64, (rows,)),
    ]


def test_rows_written_in_any_order_from_several_threads_make_one_file(tmp_path):
    """A file of several digest blocks whose rows arrive out of order, from threads at once,
    is the file written front to back, with the digest of its bytes."""
    rows, width = 3000, 3072  # bf16: 18 MB of rows, two blocks and a part
    g = torch.Generator().manual_seed(5)
    a = torch.randn(rows, width, generator=g).bfloat16()
    b = torch.randint(0, 1 << 40, (rows,), generator=g)
    fields, meta = shard_file_fields(rows, width), {"format": "test"}
    in_order = shards.ShardFile(tmp_path / "x.safetensors", fields, meta)
    in_order.write("b", 0, b)
    in_order.write("a", 0, a)
    want = in_order.close()
    pieces = torch.randperm(rows, generator=g)[:29].sort().values.tolist()
    spans = list(zip([0, *pieces], [*pieces, rows]))
    order = torch.randperm(len(spans), generator=g).tolist()
    out = shards.ShardFile(tmp_path / "y.safetensors", fields, meta)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: out.write("a", spans[i][0], a[spans[i][0] : spans[i][1]]), order))
    out.write("b", 0, b)
    got = out.close()
    data = (tmp_path / "y.safetensors").read_bytes()
    assert data == (tmp_path / "x.safetensors").read_bytes() and len(data) > 2 * (8 << 20)
    assert got == want and got.sha256 == reference_digest(data) and got.bytes == len(data)
    assert shards.digest_path(tmp_path / "y.safetensors", threads=1) == got.sha256
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors", "y.safetensors"]


def test_a_file_with_rows_never_written_is_refused_and_left_no_trace(tmp_path):
    fields = shard_file_fields(100, 8)
    out = shards.ShardFile(tmp_path / "x.safetensors", fields, {"format": "test"})
    out.write("a", 0, torch.zeros(60, 8, dtype=torch.bfloat16))
    out.write("b", 0, torch.zeros(100, dtype=torch.int64))
    with pytest.raises(ValueError, match="never written"):
        out.close()
    assert list(tmp_path.iterdir()) == []


def test_rows_written_twice_or_off_the_field_are_refused(tmp_path):
    with shards.ShardFile(tmp_path / "x.safetensors", shard_file_fields(10, 8), {}) as out:
        out.write("a", 0, torch.zeros(6, 8, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="written twice"):
            out.write("a", 5, torch.zeros(2, 8, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="outside"):
            out.write("a", 8, torch.zeros(3, 8, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="stores"):
            out.write("a", 0, torch.zeros(1, 8, dtype=torch.float32))
        out.abort()
    assert list(tmp_path.iterdir()) == []


def test_an_exception_inside_the_writer_removes_its_temporary_file(tmp_path):
    with pytest.raises(RuntimeError, match="stop"):
        with shards.ShardFile(tmp_path / "x.safetensors", shard_file_fields(10, 8), {}) as out:
            out.write("a", 0, torch.zeros(10, 8, dtype=torch.bfloat16))
            raise RuntimeError("stop")
    assert list(tmp_path.iterdir()) == []


def test_digests_of_bytes_and_of_files_agree_across_block_edges(tmp_path):
    for size in (0, 1, (8 << 20) - 1, 8 << 20, (8 << 20) + 1, 3 * (8 << 20) + 77):
        data = bytes(range(256)) * (size // 256) + bytes(size % 256)
        path = tmp_path / f"f{size}"
        path.write_bytes(data)
        assert (
            shards.digest_bytes(data) == shards.digest_path(path) == reference_digest(data)
            if size
            else shards.digest_bytes(data) == shards.digest_path(path)
        )
        assert shards.digest_matches(shards.digest_path(path), path=path) == (
            True,
            shards.digest_path(path),
        )
        assert shards.digest_matches(hashlib.sha256(data).hexdigest(), data=data)[0]
