"""The drafting methods eaglet trains (``train.method``), each drafter built, exported, loaded
and replayed by one name: EAGLE-3 (:mod:`eaglet.model.drafter`, a chain of k forwards),
P-EAGLE (:mod:`eaglet.model.peagle`, k masked slots in one forward of the EAGLE-3 layer) and
DFlash (:mod:`eaglet.model.dflash`, a block of k masked slots in one forward of its own
layers over the target's context)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from eaglet.model import dflash, export as eagle3_export, peagle
from eaglet.model.config import METHODS, DrafterConfig, exported_method
from eaglet.model.drafter import Eagle3Drafter
from eaglet.model.init import LayerFit, init_from_target
from eaglet.model.replay import draft_chain, draft_parallel


def make_drafter(method: str, target_config: dict, config: DrafterConfig,
                 embed_tokens: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor,
                 layers: int = 1) -> torch.nn.Module:
    """The drafter ``train.method`` trains: EAGLE-3's, P-EAGLE's or DFlash's (``layers``
    deep: train.dflash_layers), the masked slots of the last two on the target's mask token
    (:func:`eaglet.model.peagle.mask_token_id`)."""
    if method == "eagle3":
        return Eagle3Drafter(config, embed_tokens, d2t, t2d)
    if method == "peagle":
        if config.attention_kind != "llama":
            raise ValueError("train.method: peagle needs train.drafter_attention: llama (vLLM "
                             "0.32 keeps the parallel-drafting mask_hidden only in its Llama "
                             "EAGLE-3 drafter, llama_eagle3.py)")
        return peagle.PEagleDrafter(config, embed_tokens, d2t, t2d,
                                    peagle.mask_token_id(target_config))
    if method == "dflash":
        return dflash.DFlashDrafter(config, embed_tokens, d2t, t2d,
                                    peagle.mask_token_id(target_config), layers)
    raise ValueError(f"train.method {method!r} is none of {', '.join(METHODS)}")


def init_layer_from_target(model: torch.nn.Module, target_dir, layer: int) -> LayerFit:
    """``train.layer_init: target`` for the drafter ``model`` is: its layers from the
    target's layer ``layer`` where they fit."""
    if isinstance(model, dflash.DFlashDrafter):
        return dflash.init_from_target(model, target_dir, layer)
    return init_from_target(model, target_dir, layer)


def export(model: torch.nn.Module, out_dir: str | Path, dtype: str = "float32",
           block_size: int | None = None) -> dict:
    """Any method's drafter in vLLM's format (``block_size``: DFlash's trained block)."""
    if isinstance(model, dflash.DFlashDrafter):
        return dflash.export_dflash(model, out_dir, dtype, block_size)
    if isinstance(model, peagle.PEagleDrafter):
        return peagle.export_peagle(model, out_dir, dtype)
    return eagle3_export.export_drafter(model, out_dir, dtype)


def load(drafter_dir: str | Path, target_dir: str | Path, dtype: torch.dtype = torch.float32,
         method: str | None = None) -> torch.nn.Module:
    """The drafter exported in ``drafter_dir``, whatever its method (``method``, else what its
    config.json says), with the target's embedding, ready to run (eval mode)."""
    method = method or exported_method(drafter_dir)
    if method == "dflash":
        return dflash.load_dflash(drafter_dir, target_dir, dtype)
    if method == "peagle":
        return peagle.load_peagle(drafter_dir, target_dir, dtype)
    return eagle3_export.load_drafter(drafter_dir, target_dir, dtype)


def draft_function(drafter: torch.nn.Module) -> Callable:
    """How ``drafter`` drafts one round in vLLM (``draft(drafter, aux, ids, p, k)``): one
    forward for P-EAGLE and DFlash, a chain of k for EAGLE-3."""
    if isinstance(drafter, (peagle.PEagleDrafter, dflash.DFlashDrafter)):
        return draft_parallel
    return draft_chain
