"""The speculative-decoding methods eaglet knows, one record each: the drafters it trains
(``train.method``: EAGLE-3, P-EAGLE, DFlash), the layer variants of EAGLE-3
(``train.drafter_variant``: EAGLE-3.1's norms) and vLLM's own speculation that the evaluation
serves beside them (n-gram lookup, the target's MTP layers).

A record says what a method is to every part of the pipeline that plans, checks or serves it
without building it: its constraints on the drafter's attention and variant (and why vLLM
imposes them), how vLLM serves it (``--speculative-config``), how its exported config.json
names it, its label and its cost in layer passes a training token. The records are
torch-free: ``eaglet plan``, ``eaglet status`` and every Snakefile parse read them. What
builds, initializes, exports, loads and drafts each one is its provider in
:mod:`eaglet.model.methods`, keyed by the record.

Every literal name of a method lives here (a test reads the code for others). Adding a
method: a record here (and in ``METHODS``), a provider in :mod:`eaglet.model.methods` (its
module beside ``model/peagle.py``), its name in the schema's ``train.method`` enum.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from eaglet.core.io import read_json


@dataclass(frozen=True)
class Variant:
    """A layer variant of the EAGLE-3 drafter (``train.drafter_variant``): the norms it
    writes into config.json for vLLM (0.32 reads them, llama_eagle3.py)."""

    name: str  # train.drafter_variant
    label: str  # in a run's name (``eagle31_k3``)
    words: str
    flags: dict = field(default_factory=dict)  # the norm flags it sets (the rest stay false)


EAGLE3_LAYER = Variant("eagle3", "eagle3", "EAGLE-3")
EAGLE31 = Variant("eagle3.1", "eagle31", "EAGLE-3.1", {"fc_norm": True, "norm_output": True})
VARIANTS = {v.name: v for v in (EAGLE3_LAYER, EAGLE31)}
ATTENTION_KINDS = ("llama", "mla")  # train.drafter_attention


@dataclass(frozen=True)
class Method:
    """A drafter eaglet trains (``train.method``)."""

    name: str  # train.method, and its runs' label (``peagle_k3``)
    words: str  # in words
    served_as: str  # vLLM's ``"method"`` in --speculative-config
    # keys vLLM reads from the speculative config itself, not the drafter's config.json
    served_keys: dict = field(default_factory=dict)
    attentions: tuple = ATTENTION_KINDS  # the train.drafter_attention it can be built with
    variants: tuple = tuple(VARIANTS)  # the train.drafter_variant it can be built with
    requirement: str = ""  # why only those (what vLLM builds), where it is not all of them
    parallel: bool = False  # drafts its k tokens in one forward (else a chain of k)
    mask_hidden: bool = False  # a learned [3H] vector fills the masked slots' aux features
    # a stack of train.dflash_layers layers drafting a block of ttt_steps + 1 slots, which
    # attends to the target's aux states of the whole context
    block: bool = False
    layer_kind: str = ""  # the model family of its layers, where it is not the target's
    architecture: str | None = None  # the exported config.json's architecture that names it
    config_flag: str | None = None  # or the flag in it that does
    # whether vLLM's CPU engine serves it beside a target with MLA attention
    cpu_beside_mla: bool = True

    def refusal(self, attention: str, variant: str) -> str | None:
        """Why this method cannot be built with ``train.drafter_attention`` ``attention`` and
        ``train.drafter_variant`` ``variant`` (None where it can)."""
        if attention not in ATTENTION_KINDS:
            return f"train.drafter_attention {attention!r} is none of {', '.join(ATTENTION_KINDS)}"
        if variant not in VARIANTS:
            return f"train.drafter_variant {variant!r} is none of {', '.join(VARIANTS)}"
        if attention in self.attentions and variant in self.variants:
            return None
        return f"train.method: {self.name} needs {self.takes()} ({self.requirement})"

    def takes(self) -> str:
        """The settings it can be built with, as a config says them."""
        takes = f"train.drafter_attention: {' or '.join(self.attentions)}"
        if len(self.variants) < len(VARIANTS):
            takes += f" and train.drafter_variant: {' or '.join(self.variants)}"
        return takes

    def layer_passes(self, ttt_steps: int, layers: int = 1) -> int:
        """The drafter layer passes one training token costs at ``ttt_steps``: a TTT step each,
        or a block's ttt_steps + 1 slots through each of its ``layers``."""
        return (ttt_steps + 1) * layers if self.block else ttt_steps

    def depth(self, layers: int, kind: bool = False) -> str:
        """Its depth in words where it has one (train.dflash_layers), else '' (``kind``: with
        its layers' model family)."""
        family = f"{self.layer_kind} " if kind and self.layer_kind else ""
        return f"{layers} {family}layer{'s' if layers > 1 else ''}" if self.block else ""

    def speculative_config(self, drafter_dir: str | os.PathLike, k: int) -> dict:
        """vLLM's ``--speculative-config`` serving the drafter in ``drafter_dir`` at ``k``."""
        return {
            "method": self.served_as,
            "num_speculative_tokens": k,
            "model": str(drafter_dir),
            **self.served_keys,
        }


EAGLE3 = Method("eagle3", "EAGLE-3", served_as="eagle3")
PEAGLE = Method(
    "peagle",
    "P-EAGLE",
    served_as="eagle3",
    # vLLM does not read it from the drafter's config.json; without it vLLM drafts k times
    # autoregressively, with mask_hidden ignored
    served_keys={"parallel_drafting": True},
    config_flag="parallel_drafting",
    attentions=("llama",),
    parallel=True,
    mask_hidden=True,
    requirement="vLLM 0.32 keeps the parallel-drafting mask_hidden only in its Llama EAGLE-3 "
    "drafter, llama_eagle3.py",
)
DFLASH = Method(
    "dflash",
    "DFlash",
    served_as="dflash",
    architecture="DFlashDraftModel",
    attentions=("llama",),
    variants=(EAGLE3_LAYER.name,),
    parallel=True,
    block=True,
    layer_kind="Qwen3",
    cpu_beside_mla=False,
    requirement="vLLM's DFlash drafter is a stack of Qwen3 layers with norms of its own, "
    "qwen3_dflash.py: neither MLA attention nor the EAGLE-3.1 norms",
)
METHODS = {m.name: m for m in (EAGLE3, PEAGLE, DFLASH)}
DEFAULT = EAGLE3


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 aux layers of a target of ``num_layers``: early, middle and late
    (what a drafter whose config names none reads)."""
    return [2, num_layers // 2, num_layers - 3]


def method(name: str) -> Method:
    """The record of ``train.method`` ``name``."""
    if name not in METHODS:
        raise ValueError(f"train.method {name!r} is none of {', '.join(METHODS)}")
    return METHODS[name]


def from_config(config: dict) -> Method:
    """The method a drafter's exported ``config.json`` (dict) names: by its architecture,
    else by its flag, else EAGLE-3 (the plain EAGLE-3 layout names no method)."""
    architectures = config.get("architectures") or []
    for m in METHODS.values():
        if (m.architecture and m.architecture in architectures) or (
            m.config_flag and config.get(m.config_flag)
        ):
            return m
    return DEFAULT


def exported(drafter_dir: str | os.PathLike | None) -> Method:
    """The method of the drafter exported in ``drafter_dir``; EAGLE-3 where no config.json is
    there yet (the plan of a run not trained yet)."""
    if drafter_dir is None or not (Path(drafter_dir) / "config.json").is_file():
        return DEFAULT
    return from_config(read_json(Path(drafter_dir) / "config.json"))


def variant_of(norm_flags: dict) -> Variant:
    """The EAGLE-3 variant whose flags ``norm_flags`` (a drafter's, or its exported config's
    as vLLM reads them) carry."""
    for v in sorted(VARIANTS.values(), key=lambda v: -len(v.flags)):
        if all(norm_flags.get(f) == value for f, value in v.flags.items()):
            return v
    return EAGLE3_LAYER


@dataclass(frozen=True)
class Speculation:
    """vLLM's own speculation, which the evaluation serves beside the drafter and which no
    drafter is trained for."""

    name: str  # vLLM's ``"method"``, and its runs' label
    runs_layers: bool  # it runs model layers (its draft model's, or the target's)
    drafts_every_step: bool  # it proposes at every step (n-gram lookup only where one recurs)


NGRAM = Speculation("ngram", runs_layers=False, drafts_every_step=False)
SUFFIX = Speculation("suffix", runs_layers=False, drafts_every_step=False)
MTP = Speculation("mtp", runs_layers=True, drafts_every_step=True)
SPECULATIONS = {s.name: s for s in (NGRAM, SUFFIX, MTP)}


def drafts_every_step(name: str) -> bool:
    """Whether a run of method ``name`` (a trained drafter's or vLLM's own) proposes at every
    step it is given."""
    return SPECULATIONS[name].drafts_every_step if name in SPECULATIONS else True


def words(name: str) -> str:
    """A trained method's name in words (``P-EAGLE``); vLLM's own by its name."""
    return METHODS[name].words if name in METHODS else name
