"""A vLLM general plugin (entry point group ``vllm.general_plugins``) that fixes vLLM's CPU
engine where it verifies sampled drafts wrongly.

vLLM's rejection sampler expands per-request sampling parameters (temperature, top_k, top_p)
to one value per draft token with ``expand_batch_to_tokens``. Without Triton, vLLM's CPU
platform routes that expand to a C++ fallback that writes into an int64 copy of the output,
so a float output (the temperatures) is left as uninitialized memory and acceptance at
temperature > 0 is not the model's. The fix replaces ``expand_batch_to_tokens`` by one that
keeps the dtype, only where vLLM's own function is seen to be wrong: a vLLM that fixed its
fallback, or an engine that runs the Triton kernel, is left alone.

It also fixes the CPU kernel of ``rms_norm`` where DFlash needs it: vLLM's DFlash drafter
(``qwen3_dflash.DFlashQwen3Model._normalize_context_k``) normalizes the context keys of all its
layers in one call, input [L, tokens, heads, head_dim] with a weight [L, head_dim], one row per
layer; the CPU kernel applies row 0 to every layer, so a DFlash drafter of two or more layers
drafts from wrong keys, silently. The fix (:func:`fix_grouped_norm_if_needed`) wraps
``vllm._custom_ops.rms_norm`` to call it once per layer for such a weight, again only where
the kernel is seen to be wrong.

vLLM loads general plugins in every process (API server, engine core, workers), before the
worker installs the platform's fallback kernels; the expand check therefore runs right after
that installation when it cannot run yet, and so does the norm check (in the worker, which
imports vLLM's kernels anyway; the API server never loads them).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from eaglet.target.norm import rms_norm

# A child of vLLM's logger, so the lines go where vLLM's go (its handler, its level).
log = logging.getLogger("vllm.eaglet_plugin")

SAMPLER_MODULE = "vllm.v1.sample.rejection_sampler"
FUNCTION = "expand_batch_to_tokens"
_MARK = "_eaglet_dtype_preserving"


class ExpandNotReady(RuntimeError):
    """vLLM's expand cannot run yet (no kernel implementation installed)."""


def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from=0, replace_to=0):
    """vLLM's ``expand_batch_to_tokens`` contract, in the input's dtype: ``x`` [batch] to
    [num_tokens], request i repeated ``cu_num_tokens[i] - cu_num_tokens[i-1]`` times, its
    value replaced by ``replace_to`` where it equals ``replace_from``."""
    import torch

    if x.shape[0] != cu_num_tokens.shape[0]:
        raise ValueError(
            f"expand_batch_to_tokens: {x.shape[0]} values for "
            f"{cu_num_tokens.shape[0]} cumulative token counts"
        )
    cu = cu_num_tokens.to(device=x.device, dtype=torch.long)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(values, counts, output_size=num_tokens)


setattr(expand_batch_to_tokens, _MARK, True)


def expand_preserves_dtype(expand: Callable) -> bool:
    """Whether ``expand`` (vLLM's ``expand_batch_to_tokens`` signature) expands float values
    exactly, as the rejection sampler needs for its per-token temperatures; raises
    :class:`ExpandNotReady` where it cannot run (vLLM without Triton before the platform
    installed its fallback kernels)."""
    return _mismatch(expand) is None


def _mismatch(expand: Callable) -> str | None:
    """None if ``expand`` is right on float values, else what it returned and what it should.

    The values are drawn afresh each call: a wrong expand returns uninitialized memory, which
    may hold a previous call's expected values."""
    import random

    import torch

    draw = random.Random()  # a private generator: vLLM's seeded ones stay untouched
    a, b, c = (0.25 + 2 * draw.random() for _ in range(3))
    cu = torch.tensor([2, 3], dtype=torch.int32)  # 2 tokens for request 0, 1 for request 1
    cases = [  # (values, replace_from, replace_to): plain, then as the sampler calls it for
        (torch.tensor([a, b]), 0, 0),  # temperatures (greedy requests' 0 read as 1)
        (torch.tensor([c, 0.0]), 0, 1),
    ]
    for x, replace_from, replace_to in cases:
        try:
            got = expand(x, cu, 3, replace_from=replace_from, replace_to=replace_to)
        except TypeError as error:  # the bare Triton function, not launchable without Triton
            raise ExpandNotReady(str(error)) from error
        swapped = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
        want = swapped[[0, 0, 1]]
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            return (
                f"{_fmt(x)} with cumulative token counts [2, 3] to {_fmt(got)} "
                f"({got.dtype}) instead of {_fmt(want)}"
            )
    return None


def _fmt(t) -> str:
    return "[" + ", ".join(f"{float(v):.4g}" for v in t.flatten()) + "]"


def _replace_everywhere(original: Callable, replacement: Callable) -> list[str]:
    """Point the sampler module's name, and any vLLM module that imported the function by
    name, at ``replacement``; returns the names rebound. Modules outside vLLM keep theirs."""
    rebound = []
    for name, module in list(sys.modules.items()):
        if name != "vllm" and not name.startswith("vllm."):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            if value is original:
                setattr(module, attr, replacement)
                rebound.append(f"{name}.{attr}")
    return rebound


def fix_if_needed() -> bool | None:
    """Check vLLM's expand and replace it if it loses float values: True if replaced, False if
    it is correct (or already replaced), None if it cannot be checked yet."""
    import importlib

    sampler = importlib.import_module(SAMPLER_MODULE)
    current = getattr(sampler, FUNCTION)
    if getattr(current, _MARK, False):
        return False
    try:
        wrong = _mismatch(current)
    except ExpandNotReady:
        return None
    if wrong is None:
        log.debug(
            "eaglet: vLLM's %s.%s keeps float values; nothing to fix", SAMPLER_MODULE, FUNCTION
        )
        return False
    rebound = _replace_everywhere(current, expand_batch_to_tokens)
    log.info(
        "eaglet: replaced %s with a dtype-preserving expand: vLLM's expanded %s, so "
        "the per-token temperatures of sampled draft verification were wrong",
        ", ".join(rebound),
        wrong,
    )
    return True


# -- the grouped RMSNorm of DFlash's context keys ---------------------------------------------

NORM_MODULE = "vllm._custom_ops"


def grouped_rms_norm(original: Callable) -> Callable:
    """``original`` (vLLM's ``rms_norm(out, input, weight, epsilon)``), called once per layer
    where ``weight`` holds one row per layer ([L, D] beside an input [L, ..., D]), as DFlash's
    grouped key norm calls it; any other call passes straight through."""

    def rms_norm(out, input, weight, epsilon):
        if (
            weight.dim() == 2
            and input.dim() >= 3
            and weight.shape[0] == input.shape[0]
            and out.shape == input.shape
        ):
            for i in range(weight.shape[0]):
                original(out[i], input[i].contiguous(), weight[i].contiguous(), epsilon)
            return None
        return original(out, input, weight, epsilon)

    setattr(rms_norm, _MARK, True)
    rms_norm.__wrapped__ = original
    return rms_norm


def _norm_mismatch(kernel: Callable) -> str | None:
    """None if ``kernel`` (vLLM's ``rms_norm(out, input, weight, epsilon)``) normalizes a
    [2, 3, 2, 8] input by a [2, 8] weight row per layer, else how far off it is."""
    import torch

    generator = torch.Generator().manual_seed(0)  # vLLM's seeded generators stay untouched
    x = torch.randn(2, 3, 2, 8, generator=generator)
    weight = torch.rand(2, 8, generator=generator) + 0.5
    out = torch.empty_like(x)
    kernel(out, x, weight, 1e-6)
    want = rms_norm(x, weight[:, None, None], 1e-6)
    error = float((out - want).abs().max())
    return None if error < 1e-4 else f"off by up to {error:.3g}"


def fix_grouped_norm_if_needed() -> bool:
    """Check vLLM's ``rms_norm`` with one weight row per layer and wrap it if it applies the
    first row to every layer: True if wrapped, False if correct (or wrapped already)."""
    import importlib

    ops = importlib.import_module(NORM_MODULE)
    current = ops.rms_norm
    if getattr(current, _MARK, False):
        return False
    wrong = _norm_mismatch(current)
    if wrong is None:
        log.debug("eaglet: vLLM's rms_norm takes one weight per layer; nothing to fix")
        return False
    rebound = _replace_everywhere(current, grouped_rms_norm(current))
    log.info(
        "eaglet: wrapped %s to normalize layer by layer: with one weight row per layer "
        "(DFlash's context keys) it was %s",
        ", ".join(rebound),
        wrong,
    )
    return True


def _check_after_platform_kernels(platform_cls: type) -> None:
    """Wrap the platform's ``register_triton_kernel_overrides`` (called by each worker after
    the plugins load) so the check runs once the fallback kernels are in place."""
    original = platform_cls.register_triton_kernel_overrides
    if getattr(original, _MARK, False):
        return

    def register_triton_kernel_overrides(cls) -> None:
        original()
        try:
            if fix_if_needed() is None:
                log.warning(
                    "eaglet: vLLM's rejection sampler expand cannot run even after "
                    "the platform's kernel overrides; left as it is"
                )
        except Exception:
            log.warning(
                "eaglet: checking vLLM's rejection sampler expand failed; left as it is",
                exc_info=True,
            )
        try:
            fix_grouped_norm_if_needed()
        except Exception:
            log.warning(
                "eaglet: checking vLLM's rms_norm with one weight per layer failed; "
                "left as it is (a DFlash drafter of 2+ layers may draft wrongly on "
                "the CPU engine)",
                exc_info=True,
            )

    setattr(register_triton_kernel_overrides, _MARK, True)
    register_triton_kernel_overrides.__wrapped__ = original
    platform_cls.register_triton_kernel_overrides = classmethod(register_triton_kernel_overrides)


def register() -> None:
    """Entry point of ``vllm.general_plugins``. Never raises: a failure is logged as a
    warning and vLLM runs as it would without the plugin."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            # The check expands host tensors, which only the CPU engine's expand takes; other
            # platforms run the Triton kernel, which keeps the dtype.
            log.debug("eaglet: %s platform, no CPU expand to check", current_platform.device_type)
            return
        fix_if_needed()
        # the expand once the kernels are in (where it could not be checked yet), and the
        # grouped norm in the worker, which loads the kernels anyway
        _check_after_platform_kernels(type(current_platform))
    except Exception:
        log.warning(
            "eaglet: the vLLM plugin eaglet_cpu_fixes failed and did nothing; vLLM "
            "runs unpatched (sampled acceptance on its CPU engine may be wrong)",
            exc_info=True,
        )
