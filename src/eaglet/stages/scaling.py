"""What more data buys, predicted: held-out AL against training tokens, and the data a goal needs.

The drafter is trained again on nested subsets of the training samples (``scaling.fractions``,
a quarter and a half by default) with the full run's train settings; each run's held-out
simulated AL (of the weights it ships, the best held-out evaluation's: ``shipped.heldout_al``
of its stats.json) and the full run's are fitted as ``AL = a + b * ln(training tokens)``. The
fit, inverted at ``scaling.target_al``, gives the training tokens that AL needs, and the
generation rate this run measured the time generating their answers takes.

Subsets: every sample ranked by a hash of its id, each fraction the first ``round(f * n)`` of
that ranking, so a smaller subset lies inside every larger one and the choice depends on
neither the shard layout nor the order of extraction. Training tokens: a sample's tokens as
training reads them (cut at ``train.max_len``); answer tokens: the completion tokens among them,
what generation has to produce.

A slope b <= 0 (more data did not raise held-out AL on these points) predicts nothing: the
result says so instead of extrapolating. Files: ``scaling/<fraction>/`` (the subset's drafter,
stats.json, training_log.csv and ``subset.json``; checkpoints in ``checkpoints/``) and
``eval/scaling.json``.

CLI, on a finished run's results (what rules/scaling.smk runs, one job per subset)::

    python -m eaglet.stages.scaling run --results results [--out DIR]   # every subset, then the fit
    python -m eaglet.stages.scaling train --results results --fraction 0.25 [--out DIR]
    python -m eaglet.stages.scaling fit --results results [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eaglet.core import rates
from eaglet.core.config import validate
from eaglet.core.io import read_json, write_json
from eaglet.core.layout import (
    DRAFTER,
    DRAFTER_STATS,
    HIDDEN,
    MANIFEST,
    PROGRESS,
    RUN_CONFIG,
    SCALING,
    SCALING_RUNS,
    SYNTHETIC_STATS,
    TARGET_JSON,
    VOCAB_MAP,
    fraction_name,
)
from eaglet.data.shards import read_metadata
from eaglet.stages.scripting import setup_logging
from eaglet.stages.train.loop import launch_torchrun, settings, train

log = logging.getLogger("eaglet.stages.scaling")

THIS_RUN = "this run's generation"
# a target that needs more than this many times the run's data is no prediction
FAR = 1e6
MEASURE = (
    "held-out simulated AL of the weights each run ships (its best held-out "
    "evaluation), against ln(training tokens)"
)


class ScalingError(RuntimeError):
    """A prediction that cannot be made from these results."""


# -- the subsets -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleSize:
    id: str
    tokens: int  # as training reads it: cut at train.max_len
    answer_tokens: int  # completion tokens (loss_mask 1) among those


def sample_sizes(shard_paths: list[str], max_len: int) -> list[SampleSize]:
    """Every training sample of the shards with its token counts (reads the offsets and loss
    masks only, not the hidden states)."""
    sizes = []
    for path in shard_paths:
        ids = read_metadata(path)["sample_ids"]
        with safe_open(str(path), framework="pt") as handle:
            offsets = handle.get_tensor("offsets").long()
            mask = handle.get_tensor("loss_mask").long()
        starts = offsets[:-1]
        stops = torch.minimum(offsets[1:], starts + max_len)
        answered = torch.cat([mask.new_zeros(1), mask.cumsum(0)])  # answer tokens before row i
        answers = answered[stops] - answered[starts]
        sizes += [
            SampleSize(sid, int(n), int(a))
            for sid, n, a in zip(ids, (stops - starts).tolist(), answers.tolist())
        ]
    seen = set()
    for size in sizes:
        if size.id in seen:
            raise ScalingError(
                f"sample {size.id} is in more than one training shard: rerun "
                "extract, whose shards hold each sample once"
            )
        seen.add(size.id)
    return sizes


def _rank(sample_id: str) -> str:
    return hashlib.sha256(f"eaglet-scaling:{sample_id}".encode()).hexdigest()


def choose(sample_ids: list[str], fraction: float) -> list[str]:
    """The ids of the ``fraction`` subset (at least one sample), in the given order: the first
    ``round(fraction * n)`` by hash rank, so every smaller fraction's subset is inside it."""
    if not 0 < fraction <= 1:
        raise ScalingError(
            f"fraction {fraction} is not in (0, 1]: scaling.fractions are shares "
            "of the training samples"
        )
    keep = max(1, round(fraction * len(sample_ids)))
    chosen = set(sorted(sample_ids, key=_rank)[:keep])
    return [sid for sid in sample_ids if sid in chosen]


# -- the fit ---------------------------------------------------------------------------------


def fit(tokens: list[float], als: list[float]) -> dict:
    """Least squares ``al = a + b * ln(tokens)``: a, b, the residual of each point (measured
    minus fitted), their root mean square, and b as AL per doubling of the tokens."""
    if len(tokens) != len(als) or len({float(t) for t in tokens}) < 2:
        raise ScalingError(
            f"a fit needs points at two or more training-token counts, got "
            f"{sorted(set(tokens))}: train on more samples, or on fractions "
            "that hold different numbers of them"
        )
    if min(tokens) <= 0:
        raise ScalingError(f"training tokens must be positive, got {min(tokens)}")
    xs = [math.log(t) for t in tokens]
    mx, my = sum(xs) / len(xs), sum(als) / len(als)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, als)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    residuals = [y - (a + b * x) for x, y in zip(xs, als)]
    return {
        "a": a,
        "b": b,
        "al_per_doubling": b * math.log(2),
        "residuals": residuals,
        "rms_residual": math.sqrt(sum(r * r for r in residuals) / len(residuals)),
    }


def al_at(result: dict, tokens: float) -> float:
    return result["a"] + result["b"] * math.log(tokens)


def tokens_for(al: float, result: dict) -> float | None:
    """The training tokens at which the fit reaches ``al``; None where it never rises (b <= 0)."""
    if result["b"] <= 0:
        return None
    exponent = (al - result["a"]) / result["b"]
    return math.exp(exponent) if exponent < 700 else math.inf


# -- the prediction --------------------------------------------------------------------------


def count(n: float) -> str:
    """4.1M, 340K, 12 (two significant figures above a thousand)."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            value = n / size
            return f"{value:.2g}{unit}" if value < 10 else f"{value:,.0f}{unit}"
    return f"{n:.0f}"


def _hours(h: float) -> str:
    return f"{h:.2g}" if h < 10 else f"{h:,.0f}"


def _times(ratio: float) -> str:
    return f"{ratio:.2g}x" if ratio < 10 else f"{ratio:,.0f}x"


def generation_rate(results: Path, target: str | None) -> tuple[float | None, str]:
    """Answer tokens/s of generation: this run's (synthetic/stats.json), else the latest in
    the rates history (same target and machine first); and where it comes from."""
    run = (
        read_json(results / SYNTHETIC_STATS) if (results / SYNTHETIC_STATS).exists() else {}
    ).get("this_run") or {}
    if run.get("generated") and (run.get("completion_tokens_per_s") or 0) > 0:
        return float(run["completion_tokens_per_s"]), THIS_RUN
    entry = rates.lookup_entry(rates.GENERATE, "completion_tokens_per_s", target)
    if entry is None:
        return None, "no generation rate measured"
    here = "this machine" if entry.get("device") == rates.device_kind() else entry.get("device")
    return (
        float(entry["completion_tokens_per_s"]),
        f"the generation of {entry.get('at')} on {here} (this run generated nothing)",
    )


def predict(
    points: list[dict],
    target_al: float,
    rate: float | None = None,
    rate_source: str = "no generation rate measured",
    gpus: int = 0,
) -> dict:
    """eval/scaling.json from the measured points (each ``fraction``, ``tokens``,
    ``answer_tokens``, ``heldout_al``; fraction 1 is the full run): the fit, its check (the
    subsets alone predicting the full run), the training tokens ``target_al`` needs and the
    time generating their answers takes at ``rate`` answer tokens/s (GPU-hours where the
    generation server holds ``gpus``, else hours on this machine), and one sentence."""
    points = sorted(points, key=lambda p: p["tokens"])
    full = next((p for p in points if p["fraction"] == 1), None)
    if full is None:
        raise ScalingError("no full-run point (fraction 1): the prediction is relative to it")
    result = fit([p["tokens"] for p in points], [p["heldout_al"] for p in points])
    for p, r in zip(points, result["residuals"]):
        p["fitted_al"] = p["heldout_al"] - r
    out = {
        "measure": MEASURE,
        "points": points,
        "fit": result,
        "target_al": target_al,
        "check": _check(points, full),
    }
    needed = tokens_for(target_al, result)
    if needed is None:
        ladder = ", ".join(f"{p['heldout_al']:.2f} at {count(p['tokens'])}" for p in points)
        out.update(
            tokens_needed=None,
            extrapolates=False,
            generation=None,
            sentence=(
                f"More data did not help on these points (held-out simulated AL {ladder} training "
                f"tokens; {result['al_per_doubling']:+.3f} AL per doubling), so the fit predicts "
                f"no amount of data that reaches AL {target_al:g}."
            ),
        )
        return out
    ratio = needed / full["tokens"]
    if ratio > FAR:
        out.update(
            tokens_needed=None,
            extrapolates=False,
            generation=None,
            sentence=(
                f"More data barely helped on these points ({result['al_per_doubling']:+.3f} AL per "
                f"doubling of the training tokens): the fit puts AL {target_al:g} beyond "
                f"{FAR:,.0f}x this run's data, past anything it can predict."
            ),
        )
        return out
    answers = needed * full["answer_tokens"] / full["tokens"]
    unit = "GPU-hours" if gpus else "hours on this machine"
    generation = None
    if rate:
        hours = answers / rate / 3600 * max(gpus, 1)
        more = max(answers - full["answer_tokens"], 0) / rate / 3600 * max(gpus, 1)
        generation = {
            "answer_tokens": answers,
            "tokens_per_s": rate,
            "source": rate_source,
            "gpus": gpus,
            "unit": unit,
            "hours": hours,
            "more_hours": more,
        }
    out.update(
        tokens_needed=needed, times_this_run=ratio, extrapolates=ratio > 1, generation=generation
    )
    if full["heldout_al"] >= target_al:
        out["sentence"] = (
            f"This run already reaches AL {target_al:g} (held-out simulated AL "
            f"{full['heldout_al']:.2f}); the fit puts AL {target_al:g} at about "
            f"{count(needed)} training tokens ({_times(ratio)} this run's)."
        )
        return out
    sentence = (
        f"AL {target_al:g} would need about {count(needed)} training tokens "
        f"({_times(ratio)} this run's {count(full['tokens'])}; "
        f"{result['al_per_doubling']:+.3f} AL per doubling)"
    )
    if generation:
        whose = "this run's" if rate_source == THIS_RUN else "the measured"
        hours = (
            f"{_hours(generation['hours'])} GPU-hours of generation"
            if gpus
            else f"{_hours(generation['hours'])} hours of generation on this machine"
        )
        sentence += f", about {hours} at {whose} rate ({rate:,.0f} answer tokens/s)"
    else:
        sentence += "; no generation rate was measured to say how long generating them takes"
    out["sentence"] = sentence + "."
    return out


def _check(points: list[dict], full: dict) -> dict | None:
    """The fit of the subsets alone, at the full run's tokens, against the AL the full run
    measured: how far such a prediction lands."""
    subsets = [p for p in points if p["fraction"] != 1]
    if len({p["tokens"] for p in subsets}) < 2:
        return None
    alone = fit([p["tokens"] for p in subsets], [p["heldout_al"] for p in subsets])
    predicted = al_at(alone, full["tokens"])
    return {
        "fit_on": [p["fraction"] for p in subsets],
        "predicted_full_al": predicted,
        "measured_full_al": full["heldout_al"],
        "error": predicted - full["heldout_al"],
    }


# -- the stage -------------------------------------------------------------------------------


def train_subset(
    cfg: dict,
    fraction: float,
    shard_paths: list[str],
    eval_shard_paths: list[str],
    vocab_map: str,
    target_dir: str,
    out_dir: str,
    checkpoint_dir: str,
    progress_path: str | None,
    log_path: str | None,
    manifest: str | None = None,
    gpus: int = 0,
) -> dict:
    """Train on the ``fraction`` subset with train settings ``cfg`` (train.train's entry
    point, so the loop, the checkpoint choice and the export are the full run's) and write
    ``out_dir/subset.json``: what was trained on."""
    if not eval_shard_paths:
        raise ScalingError(
            "no held-out split to measure the subsets on: set "
            "data.eval_fraction above 0, or scaling.enabled: false"
        )
    max_len = settings(dict(cfg))["max_len"]
    sizes = sample_sizes(shard_paths, max_len)
    chosen = set(choose([s.id for s in sizes], fraction))
    subset = [s for s in sizes if s.id in chosen]
    record = {
        "fraction": fraction,
        "samples": len(subset),
        "of_samples": len(sizes),
        "tokens": sum(s.tokens for s in subset),
        "answer_tokens": sum(s.answer_tokens for s in subset),
        "sample_ids_sha256": hashlib.sha256(json.dumps(sorted(chosen)).encode()).hexdigest(),
    }
    log.info(
        "scaling: training on %d of %d samples (%.0f%%, %d of %d tokens)",
        len(subset),
        len(sizes),
        100 * fraction,
        record["tokens"],
        sum(s.tokens for s in sizes),
    )
    args = {
        "cfg": dict(cfg),
        "shard_paths": list(shard_paths),
        "eval_shard_paths": list(eval_shard_paths),
        "vocab_map": vocab_map,
        "target_dir": target_dir,
        "out_dir": out_dir,
        "checkpoint_dir": checkpoint_dir,
        "progress_path": progress_path,
        "log_path": log_path,
        "manifest": manifest,
        "train_samples": [s.id for s in subset],
    }
    if gpus > 1:
        launch_torchrun(args, gpus)
    else:
        train(**args)
    write_json(Path(out_dir) / "subset.json", record)
    return record


def point(subset_dir: Path) -> dict:
    """One subset's point: its subset.json and the held-out AL its stats.json shipped."""
    record, stats = read_json(subset_dir / "subset.json"), read_json(subset_dir / "stats.json")
    return {
        **_shipped(stats, subset_dir / "stats.json"),
        "fraction": record["fraction"],
        "samples": record["samples"],
        "tokens": record["tokens"],
        "answer_tokens": record["answer_tokens"],
        "dir": str(subset_dir),
    }


def _shipped(stats: dict, path: Path) -> dict:
    shipped = stats.get("shipped") or {}
    if shipped.get("heldout_al") is None:
        raise ScalingError(
            f"{path} records no held-out simulated AL of the shipped weights: "
            "the run had no held-out split; set data.eval_fraction above 0"
        )
    return {
        "heldout_al": shipped["heldout_al"],
        "choice": shipped.get("choice"),
        "epoch": shipped.get("epoch"),
        "steps": stats.get("steps"),
        "train_s": stats.get("elapsed_s"),
    }


def write_prediction(
    results: str | Path,
    subset_dirs: list[str | Path],
    shard_paths: list[str],
    max_len: int,
    target_al: float,
    out: str | Path,
    gpus: int = 0,
) -> dict:
    """Fit the subsets' points and the full run's (``results``/drafter) and write ``out``."""
    results = Path(results)
    sizes = sample_sizes(shard_paths, max_len)
    full = {
        **_shipped(read_json(results / DRAFTER_STATS), results / DRAFTER_STATS),
        "fraction": 1.0,
        "samples": len(sizes),
        "tokens": sum(s.tokens for s in sizes),
        "answer_tokens": sum(s.answer_tokens for s in sizes),
        "dir": str(results / DRAFTER),
    }
    target = (read_json(results / TARGET_JSON) if (results / TARGET_JSON).exists() else {}).get(
        "spec"
    )
    rate, source = generation_rate(results, target)
    prediction = predict(
        [point(Path(d)) for d in subset_dirs] + [full], target_al, rate, source, gpus
    )
    write_json(out, prediction)
    log.info("scaling: %s", prediction["sentence"])
    check = prediction["check"]
    if check:
        log.info(
            "scaling: the subsets alone predict held-out AL %.3f for the full run, which "
            "measured %.3f (error %+.3f)",
            check["predicted_full_al"],
            check["measured_full_al"],
            check["error"],
        )
    return prediction


# -- CLI on a results dir --------------------------------------------------------------------


@dataclass
class Run:
    """What the stage reads from a results dir, as the workflow names it."""

    results: Path
    cfg: dict

    @classmethod
    def open(cls, results: str | Path) -> Run:
        results = Path(results)
        recorded = results / RUN_CONFIG
        if not recorded.exists():
            raise ScalingError(
                f"{recorded} does not exist: run the workflow on {results} first "
                "(it records the config the stages ran with)"
            )
        return cls(results, validate(read_json(recorded)))

    def shards(self, split: str) -> list[str]:
        manifest = read_json(self.results / MANIFEST)
        return [
            str(self.results / HIDDEN / e["file"])
            for e in manifest.get("shards" if split == "train" else "eval_shards", [])
        ]

    @property
    def train(self) -> dict:
        # every train setting, those that only decide how the run goes (RUN_ONLY) too, as
        # the rule's script passes them
        return {k: v for k, v in self.cfg["train"].items() if k != "gpus"}

    @property
    def max_len(self) -> int:
        train = self.cfg["train"]
        return train["max_len"] or train["max_tokens_per_batch"]

    def target_dir(self) -> str:
        return read_json(self.results / TARGET_JSON)["path"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m eaglet.stages.scaling", description=__doc__.split("\n")[0]
    )
    parser.add_argument("command", choices=["run", "train", "fit"])
    parser.add_argument("--results", required=True, help="a results dir the workflow finished")
    parser.add_argument(
        "--out", help="where scaling/ and eval/scaling.json go (default: --results)"
    )
    parser.add_argument("--fraction", type=float, help="train: the subset's share")
    args = parser.parse_args(argv)
    if args.command == "train" and args.fraction is None:
        parser.error("train needs --fraction")
    setup_logging(None)
    run = Run.open(args.results)
    out = Path(args.out or args.results)
    fractions = (
        [args.fraction]
        if args.command == "train"
        else []
        if args.command == "fit"
        else run.cfg["scaling"]["fractions"]
    )
    for fraction in fractions:
        where = out / SCALING_RUNS / fraction_name(fraction)
        train_subset(
            run.train,
            fraction,
            run.shards("train"),
            run.shards("eval"),
            str(run.results / VOCAB_MAP),
            run.target_dir(),
            str(where),
            str(where / "checkpoints"),
            str(out / PROGRESS / f"scaling_{fraction_name(fraction)}.json"),
            None,
            str(run.results / MANIFEST),
        )
    if args.command != "train":
        prediction = write_prediction(
            run.results,
            [out / SCALING_RUNS / fraction_name(f) for f in run.cfg["scaling"]["fractions"]],
            run.shards("train"),
            run.max_len,
            run.cfg["scaling"]["target_al"],
            out / SCALING,
            run.cfg["server"]["gpus"],
        )
        print(prediction["sentence"])


if __name__ == "__main__":
    try:
        main()
    except ScalingError as error:
        sys.exit(f"scaling: {error}")
