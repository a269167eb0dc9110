"""The fast training step computes what the plain one does: the fused loss (lm_head, the
cross-entropy against the teacher and its gradient a chunk of rows at a time) and the compiled
elementwise kernels, checked on CPU in float32 against the plain autograd path, for one loss
and over ten optimizer steps of eaglet's trainer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from eaglet.model import loss as ttt_loss
from eaglet.model.dflash import DFlashDrafter
from eaglet.model.drafter import Eagle3Drafter, compile_drafter
from eaglet.model.kernels import EAGER
from eaglet.model.peagle import PEagleDrafter
from eaglet.stages.train.loop import Dist, Trainer, settings
from tests.test_drafter import DRAFT_VOCAB, VOCAB, H, sample, tiny_config, vocab_map


def plain_ce(z: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """The plain path's cross-entropy (eaglet.stages.train.step.batch_sums, fused=False)."""
    p = torch.softmax(teacher_logits.float(), -1)
    return (torch.logsumexp(z.float(), -1) - (p * z.float()).sum(-1)).sum()


@pytest.mark.parametrize("chunk_elements", [7 * DRAFT_VOCAB, ttt_loss.CHUNK_ELEMENTS])
def test_the_fused_head_loss_is_the_plain_one_with_its_gradients(chunk_elements, monkeypatch):
    monkeypatch.setattr(ttt_loss, "CHUNK_ELEMENTS", chunk_elements)  # several chunks, or one
    g = torch.Generator().manual_seed(3)
    final, teacher_head = torch.randn(40, H, generator=g), torch.randn(DRAFT_VOCAB, H, generator=g)
    rows = torch.randint(0, 40, (23,), generator=g)
    h = torch.randn(23, H, generator=g, requires_grad=True)
    weight = torch.randn(DRAFT_VOCAB, H, generator=g, requires_grad=True)
    t_logits, t_lse = ttt_loss.teacher(final, teacher_head)
    fused, argmax = ttt_loss.head_loss(h, weight, t_logits, t_lse, rows)
    (2.5 * fused).backward()
    got = h.grad.clone(), weight.grad.clone()
    h.grad = weight.grad = None
    z = h @ weight.T
    want = plain_ce(z, (final @ teacher_head.T)[rows])
    (2.5 * want).backward()
    torch.testing.assert_close(fused, want, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(got[0], h.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], weight.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(argmax, z.argmax(-1))
    with torch.no_grad():  # held-out: the same values, no gradient kept
        score, same = ttt_loss.head_loss(h, weight, t_logits, t_lse, rows)
    torch.testing.assert_close(score, want.detach(), rtol=1e-6, atol=1e-5)
    assert torch.equal(same, argmax)


class Samples:
    """Random samples as ``train_data.Samples`` gives them (one "shard" of all of them)."""

    def __init__(self, lengths: list[int], seed: int):
        self.pieces = [sample(n, seed + i) for i, n in enumerate(lengths)]
        self.lengths = lengths
        self.infos, self.first = [SimpleNamespace(lengths=lengths)], [0]

    def __len__(self) -> int:
        return len(self.pieces)

    def get(self, index: int, max_len: int) -> tuple:
        sid, *tensors = self.pieces[index]
        return (sid, *(t[:max_len] for t in tensors))


def trainer(tmp_path, method: str, fast: bool, variant: dict) -> Trainer:
    torch.manual_seed(0)
    d2t, t2d = vocab_map()
    config = tiny_config()
    for key, value in variant.items():
        setattr(config, key, value)
    embed = torch.randn(VOCAB, H)
    model = (
        PEagleDrafter(config, embed, d2t, t2d, mask_token_id=1)
        if method == "peagle"
        else DFlashDrafter(config, embed, d2t, t2d, mask_token_id=1)
        if method == "dflash"
        else Eagle3Drafter(config, embed, d2t, t2d)
    )
    cfg = settings(
        {
            "epochs": 10,
            "max_steps": 10,
            "lr": 3e-3,
            "warmup_steps": 2,
            "ttt_steps": 4,
            "max_len": 64,
            "max_tokens_per_batch": 96,
            "prefetch_batches": 0,
            "fused_loss": fast,
            "compile": fast,
        }
    )
    data = Samples([9, 30, 17, 5, 41, 12, 23, 8], seed=11)
    return Trainer(
        cfg,
        model,
        torch.randn(DRAFT_VOCAB, H) * 3,
        data,
        data,
        tmp_path / ("fast" if fast else "plain"),
        torch.device("cpu"),
        Dist(),
    )


@pytest.mark.subprocess  # torch.compile runs the C++ compiler
@pytest.mark.parametrize(
    "method, variant",
    [
        ("eagle3", {}),
        ("eagle3", {"fc_norm": True, "norm_output": True}),
        ("peagle", {}),
        ("dflash", {}),
    ],
)
def test_ten_steps_of_the_fast_step_are_the_plain_steps(tmp_path, method, variant):
    """Fused loss and compiled kernels against the plain autograd step: the same losses and
    gradients at every one of ten AdamW steps over packed batches of several samples, and the
    same weights after them (float32 on CPU)."""
    plain, fast = (trainer(tmp_path, method, f, variant) for f in (False, True))
    assert plain.epoch_plan(0) == fast.epoch_plan(0)
    for step in range(10):
        micro = [plain.epoch_plan(0)[step % len(plain.epoch_plan(0))]]
        a, rows_a = plain.train_step(micro)
        b, rows_b = fast.train_step(micro)
        assert rows_a == rows_b
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"step {step}")
        for (name, p), q in zip(plain.model.named_parameters(), fast.model.parameters()):
            if p.grad is not None or q.grad is not None:
                torch.testing.assert_close(
                    q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=f"{name}, step {step}"
                )
    # AdamW's first steps move a weight by about lr whatever its gradient's size, so a gradient
    # within rounding of 0 can move it either way: weights agree to a few % of one step
    for (name, p), q in zip(plain.model.named_parameters(), fast.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=0.05 * 3e-3, msg=name)
    evaluated = plain.evaluate(), fast.evaluate()
    for key in evaluated[0]:
        assert evaluated[1][key] == pytest.approx(evaluated[0][key], rel=1e-5, abs=1e-6), key


def test_compiled_kernels_can_be_switched_off_again():
    model = Eagle3Drafter(tiny_config(), torch.randn(VOCAB, H), *vocab_map())
    compile_drafter(model)
    assert model.norm.kernels is model.midlayer.mlp.kernels is not type(model.norm).kernels
    compile_drafter(model, on=False)
    assert model.norm.kernels is model.midlayer.self_attn.kernels is type(model.norm).kernels
    # any method's layers: DFlash's attention takes the compiled kernels too
    block = DFlashDrafter(tiny_config(), torch.randn(VOCAB, H), *vocab_map(), mask_token_id=1)
    compile_drafter(block)
    assert block.layers[0].self_attn.kernels is block.norm.kernels is not EAGER
