"""What builds, initializes, exports, loads and drafts each method eaglet trains: one provider
per record of :mod:`eaglet.core.methods` (which says what the method is: its constraints,
served config and label). EAGLE-3 (:mod:`eaglet.model.drafter`, a chain of k forwards), P-EAGLE
(:mod:`eaglet.model.peagle`, k masked slots in one forward of the EAGLE-3 layer) and DFlash
(:mod:`eaglet.model.dflash`, a block of k masked slots in one forward of its own layers over
the target's context)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglet.core import methods as records
from eaglet.model import dflash, peagle
from eaglet.model import export as eagle3_export
from eaglet.model.config import DrafterConfig
from eaglet.model.drafter import Eagle3Drafter
from eaglet.model.init import LayerFit, init_from_target
from eaglet.model.replay import draft_chain, draft_parallel


@dataclass(frozen=True)
class Provider:
    """A method's drafter in code, each function looked up when called (as the module
    attribute it names: a test that replaces one replaces it here too).
    ``build(target_config, config, embed, d2t, t2d, layers)``;
    ``init(model, target_dir, layer)`` (train.layer_init: target); ``export(model, out_dir,
    dtype, block_size)``; ``load(drafter_dir, target_dir, dtype)``; ``draft``: how it drafts
    one round in vLLM (``draft(drafter, aux, ids, p, k)``)."""

    model: type
    build: Callable
    init: Callable
    export: Callable
    load: Callable
    draft: Callable


PROVIDERS = {
    records.EAGLE3.name: Provider(
        Eagle3Drafter,
        build=lambda target, config, embed, d2t, t2d, layers: Eagle3Drafter(
            config, embed, d2t, t2d
        ),
        init=init_from_target,
        export=lambda model, out_dir, dtype, block_size: eagle3_export.export_drafter(
            model, out_dir, dtype
        ),
        load=lambda d, target, dtype: eagle3_export.load_drafter(d, target, dtype),
        draft=draft_chain,
    ),
    records.PEAGLE.name: Provider(
        peagle.PEagleDrafter,
        build=lambda target, config, embed, d2t, t2d, layers: peagle.PEagleDrafter(
            config, embed, d2t, t2d, peagle.mask_token_id(target)
        ),
        init=init_from_target,
        export=lambda model, out_dir, dtype, block_size: peagle.export_peagle(
            model, out_dir, dtype
        ),
        load=lambda d, target, dtype: peagle.load_peagle(d, target, dtype),
        draft=draft_parallel,
    ),
    records.DFLASH.name: Provider(
        dflash.DFlashDrafter,
        build=lambda target, config, embed, d2t, t2d, layers: dflash.DFlashDrafter(
            config, embed, d2t, t2d, peagle.mask_token_id(target), layers
        ),
        init=lambda model, target_dir, layer: dflash.init_from_target(model, target_dir, layer),
        export=lambda model, out_dir, dtype, block_size: dflash.export_dflash(
            model, out_dir, dtype, block_size
        ),
        load=lambda d, target, dtype: dflash.load_dflash(d, target, dtype),
        draft=draft_parallel,
    ),
}


def provider_of(model: torch.nn.Module) -> Provider:
    """The provider whose drafter ``model`` is (the most derived class first: P-EAGLE's
    drafter is an EAGLE-3 one)."""
    matches = [p for p in PROVIDERS.values() if isinstance(model, p.model)]
    if not matches:
        raise TypeError(f"{type(model).__name__} is no drafter of {', '.join(PROVIDERS)}")
    return max(matches, key=lambda p: len(p.model.__mro__))


def make_drafter(
    method: str,
    target_config: dict,
    config: DrafterConfig,
    embed_tokens: torch.Tensor,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    layers: int = 1,
) -> torch.nn.Module:
    """The drafter ``train.method`` trains: EAGLE-3's, P-EAGLE's or DFlash's (``layers``
    deep: train.dflash_layers), the masked slots of the last two on the target's mask token
    (:func:`eaglet.model.peagle.mask_token_id`); refused where the method cannot be built with
    ``config``'s attention (:meth:`eaglet.core.methods.Method.refusal`)."""
    record = records.method(method)
    refused = record.refusal(config.attention_kind, records.variant_of(config.norm_flags).name)
    if refused:
        raise ValueError(refused)
    return PROVIDERS[record.name].build(target_config, config, embed_tokens, d2t, t2d, layers)


def init_layer_from_target(model: torch.nn.Module, target_dir, layer: int) -> LayerFit:
    """``train.layer_init: target`` for the drafter ``model`` is: its layers from the
    target's layer ``layer`` where they fit."""
    return provider_of(model).init(model, target_dir, layer)


def export(
    model: torch.nn.Module,
    out_dir: str | Path,
    dtype: str = "float32",
    block_size: int | None = None,
) -> dict:
    """Any method's drafter in vLLM's format (``block_size``: DFlash's trained block)."""
    return provider_of(model).export(model, out_dir, dtype, block_size)


def load(
    drafter_dir: str | Path,
    target_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    method: str | None = None,
) -> torch.nn.Module:
    """The drafter exported in ``drafter_dir``, whatever its method (``method``, else what its
    config.json says), with the target's embedding, ready to run (eval mode)."""
    name = method or records.exported(drafter_dir).name
    return PROVIDERS[name].load(drafter_dir, target_dir, dtype)


def draft_function(drafter: torch.nn.Module) -> Callable:
    """How ``drafter`` drafts one round in vLLM (``draft(drafter, aux, ids, p, k)``): one
    forward for P-EAGLE and DFlash, a chain of k for EAGLE-3."""
    return provider_of(drafter).draft
