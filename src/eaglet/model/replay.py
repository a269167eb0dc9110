"""Offline acceptance: eaglet's own PyTorch replay of vLLM's greedy EAGLE-3 drafting.

Given the target's greedy continuation of each prompt, take its aux features from the
held-out shard where extraction stored that very sequence (:class:`StoredStates`: no target
loaded), else from one forward of the target (transformers), then replay the serving loop: at
a round whose last verified position is ``p`` (the target has just produced token ``p+1``),
the drafter chains ``k`` draft tokens
from row ``p`` (step 0 reads the target's features of ``p`` and the embedding of token
``p+1``; step j reads its own previous hidden state and its own previous draft, at RoPE
position ``p+j``, attending to step-0 keys of rows <= p and to its own chain). The target
accepts the longest prefix that matches its own greedy tokens and adds one token of its own,
so the next round starts at ``p + accepted + 1``. Counts are kept the way vLLM's metrics keep
them (drafts, draft tokens, accepted tokens, accepted per position), so the acceptance length
compares one to one with the `evaluate` stage's and proves the export, the aux layer ids and
the d2t mapping end to end; it also evaluates a drafter where no vLLM is available.

At a temperature above 0 the answers are sampled, and the replay gives the expected
acceptance from the target's distribution at that temperature (:func:`expected_replay`).

An answer's last round may draft past its last token: vLLM verifies those drafts against the
target's own next tokens after the stop token (or the max_tokens cut) and counts those it
accepts, then drops them from the answer. The answer cannot show those tokens, so the replay
counts the drafts it cannot judge (``past_end``): vLLM's count lies between the replay's and
the replay's plus those (a Gemma 4 miniature's drafter proposed its stop token twice, and
the target's greedy token after the stop was the stop token again: one draft more in
vLLM's counters than any replay of the answer can show).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from typing import Any

import torch

from eaglet.core.dtypes import MANTISSA_BITS
from eaglet.data import shards
from eaglet.model.attention import attention_blocks
from eaglet.model.drafter import Eagle3Drafter
from eaglet.target.hooks import AuxCapture, decoder_layers

log = logging.getLogger("eaglet.model.replay")


@torch.inference_mode()
def target_features(model, layer_ids: list[int], ids: list[int], final: bool = False):
    """Aux features [N, 3H] of one sequence; with ``final``, also the final-norm output
    [N, H] that the target's lm_head reads (its next-token logits), as a pair."""
    capture = AuxCapture(decoder_layers(model), layer_ids)
    try:
        out = model.get_decoder()(input_ids=torch.tensor([ids]), use_cache=False)
        aux = torch.cat(capture.take(), dim=-1)[0]
        return (aux, out.last_hidden_state[0]) if final else aux
    finally:
        capture.close()


@torch.inference_mode()
def draft_chain(
    drafter: Eagle3Drafter, aux: torch.Tensor, ids: torch.Tensor, p: int, k: int
) -> list[int]:
    """``k`` greedy draft tokens (target ids) from row ``p``; ``ids`` is the sequence."""
    rows = p + 1
    positions = torch.arange(rows)
    blocks = attention_blocks(torch.zeros(rows, dtype=torch.long))  # one sample: causal
    hidden = drafter.combine(aux[:rows])  # [rows, H]
    step_ids = ids[1 : rows + 1].clone()  # row t embeds token t+1
    cache: list[tuple[torch.Tensor, torch.Tensor]] = []
    drafts = []
    for step in range(k):
        cos, sin = drafter.rope(positions + step)
        embeds = drafter.embed_tokens[step_ids].to(hidden.dtype)
        normed, hidden = drafter.draft_step(embeds, hidden, cos, sin, blocks, cache, p)
        draft = int(drafter.to_target_ids(drafter.lm_head(normed).argmax()))
        drafts.append(draft)
        step_ids = step_ids.clone()
        step_ids[p] = draft  # only row p's chain matters after step 0
    return drafts


@torch.inference_mode()
def draft_parallel(drafter, aux: torch.Tensor, ids: torch.Tensor, p: int, k: int) -> list[int]:
    """The ``k`` greedy drafts (target ids) of a drafter that proposes a round in one forward
    (P-EAGLE's masked slots after row ``p``, DFlash's block after the context of rows
    ``0..p``), whose forward takes ``Eagle3Drafter.forward``'s arguments and reads only the
    first step's ids: rows ``0..p`` and row ``p``'s k results; ``ids`` is the sequence."""
    rows = p + 1
    step_ids = ids[1 : rows + 1].expand(k, rows)  # only step 0 is read
    logits = drafter(
        aux[:rows],
        step_ids,
        torch.arange(rows),
        torch.zeros(rows, dtype=torch.long),
        [torch.tensor([p])] * k,
    )
    return [int(drafter.to_target_ids(z[0].argmax())) for z in logits]


def replay(draft, ids: list[int], prompt_len: int, k: int) -> dict:
    """vLLM's counters for one greedy sequence (prompt + the target's own continuation);
    ``draft(p, k)`` returns the draft tokens proposed from row ``p`` as the server keeps them
    (:func:`kept`): none is no drafting step."""
    n = len(ids)
    counts = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_position": [0] * k, "past_end": 0}
    p = prompt_len - 1  # after prefill the target has produced token prompt_len
    while p + 2 < n:  # at least one token left to draft for
        drafts = draft(p, k)
        if not drafts:  # the server dropped the draft: the target produces one token
            p += 1
            continue
        accepted = 0
        for j, token in enumerate(drafts):
            if p + 2 + j >= n:  # past the answer's end: vLLM may accept these (see above)
                counts["past_end"] += len(drafts) - j
                break
            if token == ids[p + 2 + j]:
                accepted += 1
            else:
                break
        counts["drafts"] += 1
        counts["draft_tokens"] += len(drafts)
        counts["accepted"] += accepted
        for j in range(accepted):
            counts["per_position"][j] += 1
        p += accepted + 1
    return counts


def kept(draft, keep=None):
    """``draft(p, k)`` as the server keeps its drafts: ``keep(p, drafts)``, the longest prefix
    a grammar the server holds the answer to accepts (:mod:`eaglet.engine.grammar`); all of
    them without one."""
    if keep is None:
        return draft
    return lambda p, k: keep(p, list(draft(p, k)))


def empty_counts(k: int) -> dict:
    return {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_position": [0] * k, "past_end": 0}


def add_counts(total: dict, counts: dict) -> dict:
    """``counts`` added into ``total`` (both as :func:`replay` or :func:`expected_replay`
    keeps them); returns ``total``."""
    for key in ("drafts", "draft_tokens", "accepted"):
        total[key] += counts[key]
    for key in ("matched", "variance", "top_token", "top_token_drafts", "past_end"):
        if key in counts:
            total[key] = total.get(key, 0) + counts[key]
    total["per_position"] = [a + b for a, b in zip(total["per_position"], counts["per_position"])]
    return total


def summarize(total: dict, k: int) -> dict:
    """Acceptance length and rates from summed counts, as vLLM's metrics give them (and, for
    an expected replay, the acceptance length its answers' own tokens give, ``matched``, and
    the standard error of vLLM's acceptance length about the expected one, ``standard_error``)."""
    drafts = total["drafts"]
    out = {
        "k": k,
        **total,
        "acceptance_length": 1 + total["accepted"] / drafts if drafts else None,
        "acceptance_rate": total["accepted"] / total["draft_tokens"] if drafts else None,
        "per_position_rate": [c / drafts for c in total["per_position"]] if drafts else [],
    }
    if "matched" in total:
        out["matched_acceptance_length"] = 1 + total["matched"] / drafts if drafts else None
    if drafts and total.get("past_end"):
        # the most vLLM may count: every draft past an answer's end accepted too
        out["acceptance_length_high"] = 1 + (total["accepted"] + total["past_end"]) / drafts
        if "matched" in total:
            out["matched_acceptance_length_high"] = (
                1 + (total["matched"] + total["past_end"]) / drafts
            )
    if "variance" in total:
        out["standard_error"] = math.sqrt(total["variance"]) / drafts if drafts else None
    if total.get("top_token_drafts"):
        out["top_token_acceptance_length"] = 1 + total["top_token"] / total["top_token_drafts"]
    return out


def replay_counts(
    drafter: Eagle3Drafter,
    aux: torch.Tensor,
    prompt_ids: list[int],
    completion_ids: list[int],
    k: int,
    draft: Callable = draft_chain,
    keep: Callable | None = None,
) -> dict:
    """vLLM's counters for one greedy sequence, drafted from its aux states ``aux``
    ([at least len(prompt) + len(completion) rows, 3H], any float dtype) the way ``draft``
    drafts a round (``draft(drafter, aux, ids, p, k)``: EAGLE-3's chain of k forwards by
    default; ``eaglet.model.methods.draft_function`` names each method's), kept as the
    server keeps them (``keep``: :func:`kept`)."""
    ids = list(prompt_ids) + list(completion_ids)
    aux = aux.to(drafter.fc.weight.dtype)
    seq = torch.tensor(ids)
    drafts = kept(lambda p, n: draft(drafter, aux, seq, p, n), keep)
    return replay(drafts, ids, len(prompt_ids), k)


def offline_acceptance(
    target_model,
    drafter: Eagle3Drafter,
    sequences: list[tuple[list[int], list[int]]],
    k: int,
    draft: Callable = draft_chain,
) -> dict:
    """Acceptance over ``(prompt_ids, completion_ids)`` pairs, as vLLM would count it, from a
    forward of the target (transformers) for each; ``draft`` as :func:`replay_counts`."""
    total = empty_counts(k)
    layer_ids = drafter.config.aux_layer_ids
    for prompt_ids, completion_ids in sequences:
        aux = target_features(target_model, layer_ids, list(prompt_ids) + list(completion_ids))
        add_counts(total, replay_counts(drafter, aux, prompt_ids, completion_ids, k, draft))
    return summarize(total, k)


# -- the target's states without the target: the held-out shard ------------------------------
#
# Extraction stored the target's aux states of every held-out sample (prompt + the target's
# answer at generation). A state at row t depends on tokens 0..t only, so where evaluation's
# greedy answer to the same prompt is the stored answer or its beginning, the stored rows up
# to the answer's length are exactly the states a forward of that sequence would give (in
# the storage dtype): a 1T target need not be loaded to replay its drafter.


def coarser(stored: str, served: str) -> bool:
    """Whether states stored in ``stored`` are rounded more than the serving engine's own
    (``served``): replayed from them, the drafter reads other inputs than vLLM's."""
    return MANTISSA_BITS.get(stored, 0) < MANTISSA_BITS.get(served, 0)


class StoredStates:
    """The aux states held-out shards store, found by a sequence's tokens: the stored sample
    whose prompt tokens are the sequence's prompt and whose answer begins with its answer."""

    def __init__(self, paths: list[str | os.PathLike]):
        self.shards = [shards.open_mapped(path) for path in paths]
        if not self.shards:
            raise ValueError("no held-out shard to read stored states from")
        first = self.shards[0]
        self.dtype, self.aux_layer_ids = first.dtype, list(first.aux_layer_ids)
        for shard in self.shards[1:]:
            if shard.dtype != self.dtype or list(shard.aux_layer_ids) != self.aux_layer_ids:
                raise ValueError("the held-out shards differ in dtype or aux layer ids")
        self.by_prompt: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for i, shard in enumerate(self.shards):
            ids, mask = shard.input_ids.tolist(), shard.loss_mask.tolist()
            offsets = shard.offsets.tolist()
            for s in range(shard.num_samples):
                start, end = offsets[s], offsets[s + 1]
                # the prompt: the rows before the first completion token (loss mask 1)
                answer = next((t for t in range(start, end) if mask[t]), end)
                self.by_prompt.setdefault(tuple(ids[start:answer]), []).append((i, s))

    def find(
        self, prompt_ids: list[int], completion_ids: list[int], final: bool = False
    ) -> tuple[Any, str]:
        """The stored aux rows of ``prompt + completion`` in float32 (with ``final``: and
        their final-norm rows, as a pair) and ``"stored"``; or None and why not:
        ``"not_stored"`` (no stored sample of this prompt), ``"differs"`` (the stored answers
        are other tokens: sampled generation, batch-dependent numerics, a recorded answer),
        ``"longer_than_stored"`` (the stored answer is a beginning of this one, cut by
        extract.max_len or generate.max_tokens)."""
        found = self.by_prompt.get(tuple(prompt_ids))
        if not found:
            return None, "not_stored"
        n, why = len(completion_ids), "differs"
        for i, s in found:
            shard = self.shards[i]
            span = shard.sample(s)
            begin = span.start + len(prompt_ids)
            stored = shard.input_ids[begin : span.stop].tolist()
            if stored[:n] != list(completion_ids):
                if list(completion_ids[: len(stored)]) == stored:
                    why = "longer_than_stored"
                continue
            rows = slice(span.start, begin + n)
            scale = shard.aux_scale[rows] if shard.aux_scale is not None else None
            aux = shards.to_float(shard.aux_hidden[rows], scale)
            if not final:
                return aux, "stored"
            scale = shard.final_scale[rows] if shard.final_scale is not None else None
            return (aux, shards.to_float(shard.final_hidden[rows], scale)), "stored"
        return None, why


class TargetForwards:
    """The target's forward for the offline replays of one evaluation: the target loaded once
    for all of them (``load``, on first need), and each greedy sequence's states computed once
    (every drafter's greedy check replays the same baseline answers) while they fit in
    ``cache_bytes``; a sampled sequence's (with the final-norm states: each run samples its
    own answers) is computed each time."""

    def __init__(self, load: Callable[[], Any], cache_bytes: int = 1 << 30):
        self._load, self._model = load, None
        self._cache: dict[tuple, torch.Tensor] = {}
        self._left = cache_bytes
        self.forwards = 0  # forwards run (a test counts them)

    def __call__(self, layer_ids: list[int], ids: list[int], final: bool):
        key = (tuple(layer_ids), tuple(ids))
        if not final and key in self._cache:
            return self._cache[key]
        if self._model is None:
            self._model = self._load()
        out = target_features(self._model, layer_ids, ids, final)
        self.forwards += 1
        size = 0 if final else out.numel() * out.element_size()
        if not final and size <= self._left:
            self._cache[key] = out
            self._left -= size
        return out


class Features:
    """Where each replayed sequence's aux states come from: the held-out shard's stored
    states where its tokens are the stored ones, else a forward of the target where it can be
    loaded, else nowhere (the sequence is left out, and counted).

    ``prefer_forward``: the stored states are rounded more than the serving engine's (a
    bfloat16 or fp8 store beside a float32 server): a loadable target is run instead, so that
    the replay reads what vLLM's drafter reads; the stored states serve where it cannot be.
    ``load_target`` loads the target (float32 transformers model) on first need; None where
    it cannot be loaded (``no_forward`` says why). A load or forward that fails is reported
    once and the forward is not tried again. ``final``: each sequence's states come as a pair,
    the aux states and the final-norm ones (the target's next-token logits: an expected
    replay at a temperature needs them). ``forwards``: the :class:`TargetForwards` of
    ``load_target`` that other replays of the evaluation share (default: one of its own)."""

    def __init__(
        self,
        layer_ids: list[int],
        stored: StoredStates | None,
        load_target: Callable[[], Any] | None,
        prefer_forward: bool = False,
        no_forward: str | None = None,
        final: bool = False,
        forwards: TargetForwards | None = None,
    ):
        self.layer_ids, self.stored, self.prefer_forward = layer_ids, stored, prefer_forward
        self.final = final
        self._forwards = None if load_target is None else forwards or TargetForwards(load_target)
        self._used = False
        self.no_forward = no_forward if load_target is None else None

    @property
    def loaded(self) -> bool:
        """Whether the target was loaded (some sequence needed its forward)."""
        return self._used

    def forward(self, ids: list[int]):
        if self._forwards is None:
            return None
        try:
            out = self._forwards(self.layer_ids, ids, self.final)
            self._used = True
            return out
        except Exception as exc:  # noqa: BLE001  (any failure leaves the stored states to replay)
            self.no_forward = f"the target's forward failed: {type(exc).__name__}: {exc}"
            log.warning("offline replay: %s; replaying from stored states only", self.no_forward)
            self._forwards = None
            return None

    def __call__(
        self, prompt_ids: list[int], completion_ids: list[int]
    ) -> tuple[str | None, Any, str]:
        """``(source, aux, match)``: source ``"stored"``, ``"forward"`` or None (left out),
        the states (with ``final``: a pair), and how the sequence compared with the stored
        ones (:meth:`StoredStates.find`)."""
        aux, match = (
            self.stored.find(prompt_ids, completion_ids, self.final)
            if self.stored is not None
            else (None, "not_stored")
        )
        if aux is not None and not self.prefer_forward:
            return "stored", aux, match
        forward = self.forward(list(prompt_ids) + list(completion_ids))
        if forward is not None:
            return "forward", forward, match
        return ("stored", aux, match) if aux is not None else (None, None, match)


def replay_sequences(
    drafter: Eagle3Drafter,
    sequences: list[tuple[list[int], list[int]]],
    ks: list[int],
    features: Features,
    temperature: float = 0.0,
    head: torch.Tensor | None = None,
    greedy_counts=None,
    sampled_counts=None,
    top_p: float = 1.0,
    top_k: int = 0,
    keep_for: Callable | None = None,
) -> dict:
    """Every sequence replayed at every k from the states ``features`` gives it (each
    sequence's states got once for all k); the counts per k, summed (``counts``) and per
    sequence replayed (``per_sequence``: the acceptance length per request comes from them),
    and where the states came from: ``stored``, ``forward``, ``left_out``, and per way a
    sequence missed the stored states (``differs``, ``longer_than_stored``, ``not_stored``)
    how many did.

    At ``temperature`` 0 the greedy replay counts; above it, the expected acceptance of
    answers sampled at that temperature (:func:`expected_replay`), from ``features`` that
    give the final-norm states too (``Features(final=True)``) and the target's lm_head
    ``head`` [V, H], the distribution cut to ``top_p`` and ``top_k`` as vLLM cuts it
    (:func:`token_probability`). ``greedy_counts`` and ``sampled_counts`` count one sequence the way
    another kind of drafter drafts (P-EAGLE's one parallel forward); by default EAGLE-3's
    chain of k forwards (:func:`replay_counts`, :func:`expected_counts`). ``keep_for(prompt,
    completion)``: what the server keeps of that sequence's drafts (:func:`kept`), where it
    holds answers to a grammar."""
    if temperature and head is None:
        raise ValueError("an expected replay at a temperature needs the target's lm_head")
    greedy_counts, sampled_counts = (
        greedy_counts or replay_counts,
        sampled_counts or expected_counts,
    )
    totals = {k: empty_counts(k) for k in ks}
    per_sequence: dict[int, list[dict]] = {k: [] for k in ks}
    sources: dict[str, int] = {
        "sequences": len(sequences),
        "stored": 0,
        "forward": 0,
        "left_out": 0,
    }
    for prompt_ids, completion_ids in sequences:
        source, aux, match = features(prompt_ids, completion_ids)
        if match != "stored":
            sources[match] = sources.get(match, 0) + 1
        if aux is None:
            sources["left_out"] += 1
            continue
        sources[source] += 1
        for k in ks:
            # what the server keeps of this sequence's drafts (``keep_for``:
            # eaglet.engine.grammar.draft_filter), one grammar state per replay
            keep = {"keep": keep_for(prompt_ids, completion_ids)} if keep_for else {}
            counts = (
                sampled_counts(
                    drafter,
                    aux,
                    head,
                    prompt_ids,
                    completion_ids,
                    k,
                    temperature,
                    top_p=top_p,
                    top_k=top_k,
                    **keep,
                )
                if temperature
                else greedy_counts(drafter, aux, prompt_ids, completion_ids, k, **keep)
            )
            per_sequence[k].append(counts)
            add_counts(totals[k], counts)
    return {"counts": totals, "per_sequence": per_sequence, "sources": sources}


# -- at a temperature: the expected acceptance -----------------------------------------------
#
# What vLLM 0.32 does at T > 0 (read in v1/sample/rejection_sampler.py,
# v1/spec_decode/llm_base_proposer.py and config/speculative.py): the EAGLE proposer drafts
# greedily at every temperature (draft_sample_method "greedy", the default: the argmax of the
# draft logits, mapped to target ids through d2t, and no draft probabilities for the sampler).
# The rejection sampler then takes the draft distribution q as one-hot: it accepts draft x
# where a uniform u <= p(x) / 1, with p the target's softmax(logits / T) in float32 after
# top-k/top-p (evaluate.top_k and top_p, off by default: p is then the plain softmax at T), and on
# a rejection samples the recovered token from p with x taken out. The acceptance
# probability of a position, sum_x min(p(x), q(x)), is therefore p(x) at the drafted token.
# (With draft_sample_method "probabilistic", which eaglet does not serve, q would be the
# drafter's softmax at T through d2t, zero outside the draft vocabulary.)
#
# Two things follow. A draft is accepted exactly where the answer's token is the draft (a
# recovered token is never the rejected one): on vLLM's own answers, counting the matches
# reproduces its counters (``matched``). And a round from row p accepts in expectation
# sum_i P(drafts 1..i accepted) = sum_i prod_{j<=i} a_j, with a_j = p_j(x_j) given drafts
# 1..j-1 as context. An answer shows the target's distribution along its own tokens only, so
# a_i is known where the answer took drafts 1..i-1 (its context is then the drafts'). The
# replay adds a_i at each position while the answer has taken every earlier draft and stops
# at the first it did not: the 0/1 "took every earlier draft" estimates prod_{j<i} a_j
# without bias (answers sampled from the target at T take draft j with probability a_j), so
# no value of the target's distribution off the answer is assumed, and the drafter's later
# positions are its own chain, conditioned on its own earlier drafts, as in vLLM. Averaged
# over answers sampled at T this is vLLM's expected acceptance, with less noise than the
# matches (each round's last factor is a probability, not a 0/1 outcome); at T 0 p is one-hot
# at the target's greedy token and it is the greedy replay's count.
#
# How far vLLM's count may fall from the expectation by chance alone: position by position,
# vLLM accepts (1) or not (0) where the answer took every earlier draft, with probability a_i,
# so its count minus the replay's is a sum of differences with mean 0 given what came before
# (a martingale) and variance a_i (1 - a_i) each: the ``variance`` the replay sums. Its root
# over the drafting steps is the standard error of the acceptance length (``summarize``), what
# a comparison of the two must allow on few prompts (0 at T 0, where every a_i is 0 or 1).


def token_probability(
    logits: torch.Tensor, token: int, temperature: float, top_p: float = 1.0, top_k: int = 0
) -> float:
    """The probability that vLLM's sampler, at ``temperature``, takes ``token`` after
    ``logits`` [V]: softmax(logits / T) in float32, cut as vLLM's sampler cuts it
    (:func:`truncate`); at T 0, 1 for the greedy token (the argmax) and 0 for any other."""
    if temperature == 0:
        return float(int(logits.argmax()) == token)
    return float(probabilities(logits, temperature, top_p, top_k)[token])


def probabilities(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """vLLM's sampling distribution [V] after ``logits`` at ``temperature`` > 0 (see
    :func:`token_probability`)."""
    return torch.softmax(truncate(logits.float() / temperature, top_p, top_k), dim=-1)


def truncate(scaled: torch.Tensor, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Logits [V] at the temperature with what vLLM's top-k and top-p leave out set to -inf
    (v1/sample/ops/topk_topp_sampler.py, as the rejection sampler applies them to the
    target's logits): top-k keeps every logit at least the k-th largest (ties kept); top-p
    then drops, smallest first, the tokens whose cumulative probability in ascending order
    stays at most 1 - top_p, never the largest. 0 and 1: off."""
    if top_k and top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, -float("inf"))
    if top_p < 1.0:
        ascending, order = scaled.sort()
        dropped = torch.softmax(ascending, dim=-1).cumsum(dim=-1) <= 1 - top_p
        dropped[-1] = False
        scaled = scaled.clone()
        scaled[order[dropped]] = -float("inf")
    return scaled


def expected_replay(draft, prob, ids: list[int], prompt_len: int, k: int, top=None) -> dict:
    """vLLM's counters for one answer sampled at a temperature, in expectation (see the
    comment above): ``accepted`` and ``per_position`` sum the expected acceptances (floats),
    ``matched`` counts the drafts the answer's own tokens took (vLLM's count where the answer
    is its own), ``variance`` that count's variance about ``accepted``. Rounds advance as
    the answer's tokens took the drafts, as vLLM's did.
    ``draft(p, k)``: the k draft tokens proposed from row ``p``; ``prob(row, token)``: the
    target's probability, at the temperature, of ``token`` right after row ``row``.

    ``top(row)``, the target's most likely token right after row ``row``: the same replay,
    on the same answer, of drafts that are always that token (``top_token`` accepted over
    ``top_token_drafts`` rounds): what a drafter that proposes what the target most likely
    says would reach at this temperature, the reference a drafter's AL at T > 0 is read
    against (each first draft can do no better; a later one could, by a less likely token
    whose continuation is surer)."""
    n = len(ids)
    counts = {
        "drafts": 0,
        "draft_tokens": 0,
        "accepted": 0.0,
        "per_position": [0.0] * k,
        "matched": 0,
        "variance": 0.0,
        "past_end": 0,
    }
    p = prompt_len - 1  # after prefill the target has produced token prompt_len
    while p + 2 < n:  # at least one token left to draft for
        taken = 0
        drafts = draft(p, k)
        if not drafts:  # the server dropped the draft (:func:`replay`)
            p += 1
            continue
        for j, token in enumerate(drafts):
            if p + 2 + j >= n:  # the answer ended: the greedy replay's past_end
                counts["past_end"] += len(drafts) - j
                break
            chance = prob(p + 1 + j, token)
            counts["accepted"] += chance
            counts["variance"] += chance * (1 - chance)
            counts["per_position"][j] += chance
            if token != ids[p + 2 + j]:
                break
            taken += 1
        counts["drafts"] += 1
        counts["draft_tokens"] += len(drafts)
        counts["matched"] += taken
        p += taken + 1
    if top is not None:
        # a row predicts the token after it: drafts past the answer's last are never read
        ref = expected_replay(
            lambda p, n: [top(p + 1 + j) for j in range(n) if p + 2 + j < len(ids)],
            prob,
            ids,
            prompt_len,
            k,
        )
        counts["top_token"], counts["top_token_drafts"] = ref["accepted"], ref["drafts"]
    return counts


@torch.inference_mode()
def expected_counts(
    drafter: Eagle3Drafter,
    states: tuple[torch.Tensor, torch.Tensor],
    head: torch.Tensor,
    prompt_ids: list[int],
    completion_ids: list[int],
    k: int,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    draft: Callable = draft_chain,
    keep: Callable | None = None,
) -> dict:
    """:func:`expected_replay` of one answer sampled at ``temperature`` (cut to ``top_p`` and
    ``top_k``), drafted from its aux states (``draft`` and ``keep`` as :func:`replay_counts`) and verified
    against the target's distribution from its final-norm states (``states``: both, [at
    least len(prompt) + len(completion) rows, ...]) through the target's lm_head ``head``
    [V, H]."""
    aux, final = states
    ids = list(prompt_ids) + list(completion_ids)
    aux = aux.to(drafter.fc.weight.dtype)
    seq = torch.tensor(ids)
    prob, top = target_distribution(final, head, temperature, top_p, top_k)
    drafts = kept(lambda p, n: draft(drafter, aux, seq, p, n), keep)
    return expected_replay(drafts, prob, ids, len(prompt_ids), k, top)


def target_distribution(
    final: torch.Tensor, head: torch.Tensor, temperature: float, top_p: float, top_k: int
):
    """``prob(row, token)`` and ``top(row)`` of :func:`expected_replay` from the target's
    final-norm states [rows, H] through its lm_head [V, H]. Each row's distribution, once
    computed, leaves its most likely token and that token's probability behind: the
    top-token replay walks mostly the rows the drafter's replay computed, and asks for
    just those."""
    final, head = final.float(), head.float()
    tops: dict[int, tuple[int, float]] = {}  # row -> its most likely token, its probability

    def distribution(row: int) -> torch.Tensor | None:
        logits = final[row] @ head.T
        best = int(logits.argmax())
        if not temperature:  # one-hot at the greedy token
            tops[row] = (best, 1.0)
            return None
        p = probabilities(logits, temperature, top_p, top_k)
        tops[row] = (best, float(p[best]))
        return p

    def prob(row: int, token: int) -> float:
        if row in tops and tops[row][0] == token:
            return tops[row][1]
        p = distribution(row)
        return float(tops[row][0] == token) if p is None else float(p[token])

    def top(row: int) -> int:
        if row not in tops:
            distribution(row)
        return tops[row][0]

    return prob, top


@torch.inference_mode()
def greedy_continuations(
    target_model, prompts: list[list[int]], max_tokens: int, eos_ids: set[int]
) -> list[list[int]]:
    """The target's greedy answers with transformers, for machines without vLLM."""
    out = []
    for prompt in prompts:
        generated = target_model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=sorted(eos_ids) or None,
        )
        completion = generated[0, len(prompt) :].tolist()
        out.append(completion)
    return out
