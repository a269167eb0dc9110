"""The conversion of eaglet's data into speculators' format (benchmarks/peer_speculators.py).

speculators is a benchmark-only install (``make peer-bench-install``): without it these
tests skip.
"""

import importlib.util
import sys

import pytest
import torch

from tests.helpers.paths import REPO

BENCH = REPO / "benchmarks"
if (BENCH / ".peer").is_dir() and str(BENCH / ".peer") not in sys.path:
    sys.path.insert(0, str(BENCH / ".peer"))
pytest.importorskip("speculators")


def _bench():
    spec = importlib.util.spec_from_file_location("peer_speculators", BENCH / "peer_speculators.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rows_pass_through_prepare_data_unchanged():
    from speculators.data_generation.preprocessing import _passthrough_pretokenized

    bench = _bench()
    ids = [torch.tensor([5, 6, 7, 8, 9]), torch.tensor([1, 2, 3])]
    masks = [
        torch.tensor([0, 0, 1, 1, 1], dtype=torch.uint8),
        torch.tensor([0, 1, 1], dtype=torch.uint8),
    ]
    rows = bench.speculators_rows(("s%d" % i, ids[i], masks[i]) for i in range(2))
    out = _passthrough_pretokenized(
        {"input_ids": [r["input_ids"] for r in rows], "loss_mask": [r["loss_mask"] for r in rows]},
        8,
    )
    assert [t.tolist() for t in out["input_ids"]] == [t.tolist() for t in ids]
    assert [t.tolist() for t in out["loss_mask"]] == [t.tolist() for t in masks]
    assert out["seq_len"] == [5, 3]


def test_prenorm_surrogate_gives_back_the_teacher_through_the_target_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    bench = _bench()
    torch.manual_seed(0)
    x = torch.randn(7, 16) * 3
    norm = LlamaRMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16) + 0.5)
        final = norm(x)  # what eaglet's shards store
        again = norm(bench.prenorm_surrogate(final, norm.weight))  # what speculators computes
    torch.testing.assert_close(again, final, rtol=1e-4, atol=1e-5)
