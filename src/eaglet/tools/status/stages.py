"""The workflow's stages as ``eaglet status`` lists them: the ordered :data:`STAGES` and the
ones a config runs (:func:`run_stages`), the stages that run a model (generate, extract,
train, evaluate, scaling: what they left behind and the time they still need, from the
config's sizes and the rates :mod:`eaglet.tools.status.estimates` finds), and this machine's
measured speed that scales those estimates (:func:`machine_speed`, :func:`_at_machine_speed`).
The :class:`~eaglet.tools.status.stage.Stage` base and the stages that take a typical time
are in :mod:`eaglet.tools.status.stage`; a stage's time left is
:func:`eaglet.tools.status.time_left.estimate`."""

from __future__ import annotations

import contextlib
import glob
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eaglet.core import methods, rates
from eaglet.core.config import stream_overlaps
from eaglet.core.layout import (
    ACCEPTANCE,
    DRAFTER,
    DRAFTER_CONFIG,
    DRAFTER_STATS,
    HIDDEN,
    MANIFEST,
    PROGRESS,
    PROMPT_STATS,
    SCALING,
    SCALING_RUNS,
    SHARD_GLOB,
    SYNTHETIC_STATS,
    fraction_name,
    progress_file,
)
from eaglet.engine.support import mtp_served
from eaglet.stages.evaluate.placement import placement, recorded_target_dir
from eaglet.stages.evaluate.runs import HELD_OUT
from eaglet.stages.evaluate.schedule import sweep_runs, work_plan
from eaglet.tools.status.drafter_stats import SHIPPED_KEYS, STREAM_KEYS, _shipped_line, _stream_line
from eaglet.tools.status.estimates import (
    BENCHMARKS,
    BENCHMARKS_ONLY,
    COMPLETION_FILL_GUESS,
    NO_TOKENS,
    OFFLINE_REPLAY_SHARE,
    PACK_TOKENS_PER_S,
    Estimate,
    Machine,
    Measurement,
    Speed,
    _bench_generate,
    _checkpointed_steps,
    _guessed,
    _packed_samples,
    _pct,
    _prompt_counts,
    _rate,
    _read,
    _server_start,
    _timestamp,
    _token_totals,
    _train_rate,
    _training_rows,
    process_alive,
)
from eaglet.tools.status.stage import (
    PreparePrompts,
    PrepareTarget,
    Stage,
    StartDrafter,
    VocabMap,
)


class Generate(Stage):
    name = "generate"
    gpu_key = ("server", "gpus")
    note = "vLLM server"

    def facts(self, r):
        s = _read(r / SYNTHETIC_STATS) or {}
        splits = s.get("splits", {})
        tc = s.get("template_check", {})
        return {
            "samples": sum(v["samples"] for v in splits.values()),
            "failed": sum(v["failed"] for v in splits.values()),
            "truncated": sum(v["truncated"] for v in splits.values()),
            "completion_tokens": sum(v["completion_tokens"] for v in splits.values()),
            "template_mismatched": tc.get("mismatched"),
            "template_checked": tc.get("checked"),
            "retokenized": tc.get("retokenized"),
        }

    def line(self, f):
        return (
            f"{f['samples']} samples ({f['failed']} failed, {f['truncated']} truncated), "
            f"{f['completion_tokens']} completion tokens; template check "
            f"{f['template_mismatched']}/{f['template_checked']} mismatched"
        )

    def kind(self, cfg):
        return "decode"

    def expected_rate(self, cfg, before=None):
        return _rate(
            rates.GENERATE,
            "completion_tokens_per_s",
            cfg["target"]["model"],
            benchmark=lambda: _bench_generate(cfg["generate"]["concurrency"]),
            before=before,
            settings=rates.generate_settings(cfg),
        )

    def estimate(self, r, cfg, progress):
        target, gen = cfg["target"]["model"], cfg["generate"]
        n_train, n_eval = _prompt_counts(r)
        if n_train is None:
            return Estimate(None, "prompt count unknown until prepare_prompts runs")
        # prompts with recorded answers (answers: dataset) are not asked
        recorded = (_read(r / PROMPT_STATS) or {}).get("n_train_recorded_answers", 0)
        remaining = n_train - recorded + n_eval - (progress or {}).get("done", 0)
        rate, basis, speed = _at_machine_speed(
            self, "decode", r, cfg, lambda before: self.expected_rate(cfg, before)
        )
        if rate is None:
            return Estimate(None, basis)
        per_sample = gen["max_tokens"] * COMPLETION_FILL_GUESS
        seconds = _server_start(rates.GENERATE, target) + remaining * per_sample / rate
        text = f"{remaining} samples x ~{per_sample:.0f} tokens at {rate:.0f} tok/s ({basis})"
        if gen.get("capture_hidden_states") and recorded:
            # the capturing server prefills the recorded answers for their states as well
            prefill, _, scaled = _at_machine_speed(
                self,
                "prefill",
                r,
                cfg,
                lambda before: _rate(
                    rates.PREFILL,
                    "tokens_per_s",
                    target,
                    before=before,
                    settings=rates.prefill_settings(cfg),
                ),
            )
            if prefill:
                seconds += recorded * per_sample / prefill
                text += f", then {recorded} recorded answers prefilled at {prefill:.0f} tok/s"
                text += f" ({scaled.says('prefill')})" if scaled else ""
        return Estimate(seconds, text, speed)


class Extract(Stage):
    """Shards by the hf backend (a job each), by one vLLM capture server, or packed from
    what generation captured; the manifest verifies them all."""

    name = "extract"
    gpu_key = ("extract", "gpus")
    note = "starts only after the server stopped: both need the GPU"

    def gpus(self, cfg):
        # the vllm backend and captured states: the extraction server holds server.gpus
        from_vllm = cfg["extract"].get("backend") == "vllm" or cfg.get("generate", {}).get(
            "capture_hidden_states"
        )
        return cfg["server" if from_vllm else "extract"].get("gpus", 0)

    def read_progress(self, r, path):
        """A job that writes every shard (the vllm backend, captured states, extract.jobs:
        one) rewrites its progress file every few seconds at most, so the file can lag a
        whole shard behind (a status read 0/31 after the first shard was packed): the
        samples of the shards it wrote since it started count as done as well."""
        record = _read(path)
        if (
            not record
            or record.get("state") != "running"
            or path.stem not in ("extract_vllm", "extract_all")
        ):
            return record
        since = _timestamp(record.get("started_at"))
        if since is None:
            return record
        packed = (record.get("resumed_from") or 0) + _packed_samples(r, since)
        if record.get("total"):
            packed = min(packed, record["total"])
        return {**record, "done": packed} if packed > (record.get("done") or 0) else record

    def facts(self, r):
        m = _read(r / MANIFEST) or {}
        return {
            "shards": m.get("num_shards"),
            "samples": m.get("num_samples"),
            "tokens": m.get("tokens"),
            "truncated": m.get("truncated"),
            "bytes": m.get("bytes"),
            "dtype": m.get("dtype"),
            "aux_layer_ids": m.get("aux_layer_ids"),
            "teacher_agreement": m.get("teacher_agreement"),
        }

    def line(self, f):
        gib = (f["bytes"] or 0) / 2**30
        return (
            f"{f['shards']} shards, {f['samples']} samples, {f['tokens']} tokens, "
            f"{gib:.2f} GiB {f['dtype']}, layers {f['aux_layer_ids']}; teacher agreement "
            f"{_pct(f['teacher_agreement'])}"
        )

    def kind(self, cfg):
        # packing captured states reads and writes files: no model's work
        return None if cfg["generate"].get("capture_hidden_states") else "prefill"

    def expected_rate(self, cfg, before=None):
        target = cfg["target"]["model"]
        if cfg["extract"]["backend"] == "vllm":
            return _rate(
                rates.PREFILL,
                "tokens_per_s",
                target,
                before=before,
                benchmark=lambda: (_read(BENCHMARKS / "extract.json") or {}).get(
                    "vllm_backend_tokens_per_s"
                ),
                settings=rates.prefill_settings(cfg),
            )
        return _rate(rates.EXTRACT, rates.TOKENS_PER_S, target, before=before)

    def rate_files(self, r, cfg):
        vllm = str(r / PROGRESS / "extract_vllm.json")
        files = super().rate_files(r, cfg)
        return (
            [f for f in files if f == vllm]
            if cfg["extract"]["backend"] == "vllm"
            else [f for f in files if f != vllm]
        )

    def estimate(self, r, cfg, progress):
        target, totals = cfg["target"]["model"], _token_totals(r, cfg)
        # train.data stream: only the held-out split is extracted here
        splits = ("eval",) if cfg["train"].get("data") == "stream" else ("train", "eval")
        tokens = (
            sum(totals[split]["tokens"] for split in splits if split in totals)
            if totals is not None
            else None
        )
        if cfg["generate"].get("capture_hidden_states"):
            # generation saved the states: the stage reads, checks and packs them
            if tokens is None:
                return Estimate(None, NO_TOKENS)
            rate, basis = _rate(rates.PACK, rates.TOKENS_PER_S, target)
            if rate is None:
                rate, basis = PACK_TOKENS_PER_S, "typical"
            return Estimate(
                tokens / rate,
                f"packing {tokens} captured tokens at {rate:.0f} tok/s ({basis})"
                + _guessed(totals),
            )
        rate, basis, speed = _at_machine_speed(
            self, "prefill", r, cfg, lambda before: self.expected_rate(cfg, before)
        )
        if tokens is None or rate is None:
            return Estimate(None, basis if totals else NO_TOKENS)
        if cfg["extract"]["backend"] == "vllm":
            # one capture server; every sequence (train and held-out) is a prefill request
            return Estimate(
                _server_start(rates.PREFILL, target) + tokens / rate,
                f"server start + {tokens} tokens of prefill at {rate:.0f} tok/s "
                f"({basis})" + _guessed(totals),
                speed,
            )
        done = len(glob.glob(str(r / HIDDEN / f"{SHARD_GLOB}.safetensors")))
        left = tokens * (1 - done / max(cfg["extract"]["num_shards"], 1))
        return Estimate(
            left / rate,
            f"{left:.0f} tokens at {rate:.0f} tok/s ({basis})" + _guessed(totals),
            speed,
        )


class Train(Stage):
    name = "train"
    gpu_key = ("train", "gpus")

    def facts(self, r):
        rows = _training_rows(r)
        out: dict[str, Any] = {}
        for split in ("train", "eval"):
            last = [row for row in rows if row.get("split") == split]
            if last:
                out[f"{split}_acc_0"] = float(last[-1]["acc_0"])
                out[f"{split}_simulated_al"] = float(last[-1]["sim_al"])
        if rows:
            out["steps"] = int(rows[-1]["step"])
        if (r / DRAFTER_CONFIG).is_file():  # the exported drafter's method (train.method)
            with contextlib.suppress(OSError, ValueError):
                out["method"] = methods.exported(r / DRAFTER).name
        stats = _read(r / DRAFTER_STATS) or {}
        shipped = stats.get("shipped")
        if isinstance(shipped, dict):
            out["shipped"] = {key: shipped.get(key) for key in SHIPPED_KEYS}
        if isinstance(stats.get("stream"), dict):  # train.data stream
            out["stream"] = {key: stats["stream"].get(key) for key in STREAM_KEYS}
            out["elapsed_s"] = stats.get("elapsed_s")
        return out

    def line(self, f):
        parts = [f"step {f.get('steps')}"]
        if f.get("method") in methods.METHODS:
            parts[0] = f"{methods.words(f['method'])} drafter, {parts[0]}"
        # the eval row is the last evaluation's; the shipped drafter's is said instead
        splits = ("train",) if f.get("shipped") else ("train", "eval")
        for split in splits:
            if f"{split}_acc_0" in f:
                parts.append(
                    f"{split} acc_0 {f[f'{split}_acc_0']:.3f}, simulated AL "
                    f"{f[f'{split}_simulated_al']:.2f}"
                )
        if f.get("shipped"):
            parts.append(_shipped_line(f["shipped"]))
        if f.get("stream"):
            parts.append(_stream_line(f["stream"], f.get("elapsed_s")))
        return "; ".join(parts)

    def read_progress(self, r, path):
        """The progress file, its count raised to the newest checkpoint where the process
        wrote one after its last progress report and was then stopped (a kill between the
        two read "INTERRUPTED 1/12 steps" beside "resuming from the checkpoint at step 4")."""
        progress = super().read_progress(r, path)
        step, _ = _checkpointed_steps(r)
        if (
            progress
            and step
            and progress.get("state") == "running"
            and process_alive(progress) is False
            and step > int(progress.get("done") or 0)
        ):
            progress = {**progress, "done": step}
        return progress

    def kind(self, cfg):
        return "training"

    def expected_rate(self, cfg, before=None):
        train = cfg["train"]
        return _train_rate(
            cfg["target"]["model"],
            rates.train_passes(train),
            train["max_len"] or train["max_tokens_per_batch"],
            before,
            rates.train_settings(train, rates.training_ranks(cfg)),
        )

    def estimate(self, r, cfg, progress):
        totals, epochs = _token_totals(r, cfg), cfg["train"]["epochs"]
        rate, basis, speed = _at_machine_speed(
            self, "training", r, cfg, lambda before: self.expected_rate(cfg, before)
        )
        if totals is None or rate is None:
            return Estimate(None, basis if totals else NO_TOKENS)
        tokens = totals["train"]["tokens"] * epochs
        text = f"{epochs} epochs x {totals['train']['tokens']} tokens" + _guessed(totals)
        step, steps = _checkpointed_steps(r)
        running = _read(r / self.progress) or {}
        if (
            running.get("state") == "running"
            and running.get("resumed_from") is not None
            and process_alive(running) is not False
        ):
            # a training under way resumed from where its progress says, not from the
            # checkpoints it has written since
            step = int(running["resumed_from"])
        left = max(steps - step, 0) / steps if step else 1.0
        if step:  # a rerun continues from the newest checkpoint
            tokens *= left
            text += f", resuming from the checkpoint at step {step}/{steps}"
        seconds, text = tokens / rate, f"{text} at {rate:.0f} tok/s ({basis})"
        if cfg["train"].get("data") == "stream":
            seconds, text = self._streamed(r, cfg, totals, left, seconds, text)
        return Estimate(seconds, text, speed)

    @staticmethod
    def _streamed(r, cfg, totals, left: float, seconds: float, text: str) -> tuple:
        """train.data stream: the server's prefill of the samples still to train on (every
        epoch's without a cache, the first epoch's with one, assuming it holds every
        sample), beside the training where the two overlap (training GPUs of its own), on top
        of it where they take turns (``train.stream_overlap``: on the CPU engine's cores, or
        on the server's GPUs)."""
        extract = Extract()
        rate, basis, _ = _at_machine_speed(
            extract, "prefill", r, cfg, lambda before: extract.expected_rate(cfg, before)
        )
        if rate is None:
            return seconds, text + "; the server's prefill not estimated (" + basis + ")"
        train = cfg["train"]
        passes = train["epochs"] if not train.get("stream_cache_gib") else 1
        tokens = totals["train"]["tokens"] * passes * left
        prefill = _server_start(rates.PREFILL, cfg["target"]["model"]) + tokens / rate
        # the run trains on the CPU where it says so, or where it counts no GPU at all
        on_cpu = train["device"] == "cpu" or (
            train["device"] == "auto" and not (cfg["server"]["gpus"] or train["gpus"])
        )
        beside = stream_overlaps(
            train.get("stream_overlap", "auto"), cfg["server"]["gpus"], train["gpus"], on_cpu
        )
        total = max(seconds, prefill) if beside else seconds + prefill
        return total, (
            f"{text}; states streamed: server start + {tokens:.0f} tokens of "
            f"prefill at {rate:.0f} tok/s ({basis}), "
            + (
                "beside the training"
                if beside
                else "taking turns with it"
                if cfg["server"]["gpus"]
                else "on the same cores"
            )
        )


class Evaluate(Stage):
    name = "evaluate"
    gpu_key = ("server", "gpus")
    note = "vLLM server again"
    # its units are whole engine runs of very different lengths (the target alone is the
    # fastest, the drafter at concurrency 16 the slowest): a rate per run predicts nothing
    settles_at = 1.0
    estimates_from_progress = True  # whether the sweep chose a schedule to check

    def facts(self, r):
        v = (_read(r / ACCEPTANCE) or {}).get("verdict", {})
        keys = (
            "acceptance_length",
            "speedup_by_concurrency",
            "ngram_acceptance_length",
            "speeds_up_serving",
            "serve_never_slower_than_target",
            "warnings",
            "not_measured",
        )
        return {key: v.get(key) for key in keys}

    def line(self, f):
        if f.get("acceptance_length") is None:
            return "no drafter run"
        speedups = f.get("speedup_by_concurrency") or {}
        text = f"AL {f['acceptance_length']:.2f}, best k " + ", ".join(
            f"{x:.2f}x at concurrency {c}" for c, x in speedups.items()
        )
        if f.get("ngram_acceptance_length"):
            text += f" (ngram AL {f['ngram_acceptance_length']:.2f})"
        slow = [c for c, pays in (f.get("speeds_up_serving") or {}).items() if not pays]
        if slow:
            text += f"; does NOT speed serving up at concurrency {', '.join(slow)}"
        if f.get("serve_never_slower_than_target") is False:
            text += "; serve.json slower than the target alone somewhere"
        if f.get("not_measured"):
            text += f"; not measured: {', '.join(f['not_measured'])}"
        return text

    def kind(self, cfg):
        return "decode"

    def expected_rate(self, cfg, before=None):
        first = cfg["evaluate"]["concurrency"][0]
        return _rate(
            rates.EVALUATE,
            "baseline_tokens_per_s",
            cfg["target"]["model"],
            benchmark=lambda: _bench_generate(first),
            before=before,
            settings=rates.evaluate_settings(cfg),
        )

    def measured(self, r, cfg):
        """The target alone's decode rate at the first concurrency, as a finished evaluation
        measured it (its progress counts whole engine runs, server starts and all)."""
        result = _read(r / ACCEPTANCE) or {}
        first = (result.get("concurrency") or [None])[0]
        with contextlib.suppress(LookupError, TypeError, ValueError, ZeroDivisionError):
            levels = [lv for lv in result["runs"][0]["levels"] if lv["concurrency"] == first]
            wall = sum(float(lv["wall_s"]) for lv in levels)
            rate = sum(float(lv["output_tokens"]) for lv in levels) / wall
            if rate > 0:
                started = (_read(r / progress_file("evaluate")) or {}).get("started_at")
                return Measurement(rate, wall, started if _timestamp(started) else None)
        return None

    def decode_rates(self, r, cfg) -> tuple[Callable[[int], float] | None, str, Speed | None]:
        """The target's decode tokens/s at each concurrency of the sweep, what it rests on,
        and the measurement of this run it rests on: generation's rate where it has worked
        a minute or finished (the same engine and target on this machine), else an earlier
        evaluation's or the benchmark's at the first level, at this machine's speed where a
        stage measured one. The benchmark's server rates scale it to the other levels (how
        decode grows with more requests in flight)."""
        machine = machine_speed(r, cfg)
        generated = machine.measured_by("generate")
        at = cfg["evaluate"]["concurrency"][0]
        earlier, source = self.expected_rate(cfg, machine.since)
        if earlier is not None and getattr(source, "here", False):
            # an earlier evaluation's own rate on this machine: generation's long answers
            # at its concurrency decode faster per request than the sweep's short ones (the
            # benchmark's curve put a demo's c=1 at 18 tok/s where its evaluation measured
            # 13.5, and generation's 72 tok/s at 32 estimated one 1.3x long)
            rate, speed = earlier, None
            basis = f"decode {rate:.0f} tok/s at concurrency {at} (an earlier evaluation)"
        elif generated is not None:
            at, rate, speed = cfg["generate"]["concurrency"], generated.rate, generated
            basis = f"decode {rate:.0f} tok/s at concurrency {at}, measured by generate" + (
                f" (x{speed.factor:.2f} the benchmark's)" if speed.factor else ""
            )
        else:
            rate, source, speed = _at_machine_speed(
                self, "decode", r, cfg, lambda before: self.expected_rate(cfg, before)
            )
            if rate is None:
                return None, source, None
            basis = f"decode {rate:.0f} tok/s at concurrency {at} ({source})"
        base = _bench_generate(at)

        def rate_at(concurrency: int) -> float:
            level = _bench_generate(concurrency)
            return rate * (level / base if level and base else 1.0)

        return rate_at, basis, speed

    def estimate(self, r, cfg, progress):
        ev, target = cfg["evaluate"], cfg["target"]["model"]
        # a started evaluation's own plan of work; before it starts, the same plan from what
        # the stage will read (the sets of their own: assumed the held-out split's size)
        work = (progress or {}).get("plan")
        if not work:
            directory = recorded_target_dir(r, target)
            # the target's MTP layers as the stage serves them: none where its checkpoint
            # lacks their weights
            served = mtp_served(directory)[0] if directory else 0
            runs, replays = sweep_runs(ev, mtp_layers=served)
            _, n_eval = _prompt_counts(r)
            if n_eval is None:
                return Estimate(None, "prompt count unknown")
            n = min(n_eval, ev["max_prompts"] or n_eval)
            together = placement(cfg, directory, len(runs)).together
            sets = {HELD_OUT: n, **{entry["name"]: n for entry in ev["prompt_sets"]}}
            work = work_plan(ev, len(runs), replays, together, sets)
        rate_at, basis, speed = self.decode_rates(r, cfg)
        if rate_at is None:
            return Estimate(None, basis)
        start, measure = _server_start(rates.GENERATE, target), 0.0
        for c, requests in work["requests"].items():
            measure += requests * work["max_tokens"] * COMPLETION_FILL_GUESS / rate_at(int(c))
        measure *= work["temperatures"]  # every level at each temperature
        # the derived k schedule's check: counted until the sweep has chosen
        check = work["schedule_check"] is not False
        together, replays = work["side_by_side"], work["offline_replays"]
        runs = work["engine_runs"] + (work["schedule_check_runs"] if check else 0)
        if together:
            # the sweep's servers start up together; the check's one server on its own
            starts = _together_start(target, work["engine_runs"], start) + (start if check else 0.0)
        else:
            starts = runs * start
        seconds = starts + runs * measure + OFFLINE_REPLAY_SHARE * replays * (start + measure)
        schedule = (
            {
                None: " (the schedule's check counted until the sweep has chosen)",
                True: " (the sweep chose a schedule to check)",
                False: " (the sweep chose no schedule to check)",
            }[work["schedule_check"]]
            if work["schedule_to_check"]
            else ""
        )
        return Estimate(
            seconds,
            f"{runs} vLLM runs {'side by side' if together else 'one at a time'}"
            f"{schedule} x {len(work['prompt_sets'])} prompt sets at concurrency "
            f"{work['concurrency']}, {basis}" + (f", {replays} offline replays" if replays else ""),
            speed,
        )


def _together_start(target: str, servers: int, start: float) -> float:
    """Seconds for ``servers`` vLLM servers started together to be ready: an earlier
    evaluation's measurement, scaled to this many (on a few CPU cores their start-ups share
    the cores), else as long as one after another."""
    entry = rates.lookup_entry(rates.EVALUATE, "sweep_start_s", target)
    if entry is None:
        return servers * start
    return float(entry["sweep_start_s"]) * servers / float(entry.get("sweep_servers") or servers)


class Scaling(Stage):
    """Optional (scaling.enabled): the drafter trained again on nested subsets of the samples
    and the fit that predicts the data a target AL needs (eaglet.stages.scaling)."""

    name = "scaling"
    gpu_key = ("train", "gpus")

    def enabled(self, cfg: dict) -> bool:
        return bool(cfg.get("scaling", {}).get("enabled"))

    def facts(self, r):
        s = _read(r / SCALING) or {}
        return {"sentence": s.get("sentence"), "check": s.get("check")}

    def line(self, f):
        return f.get("sentence") or "no prediction"

    def estimate(self, r, cfg, progress):
        # the subsets not trained yet, each its share of the full training
        left = sum(
            f
            for f in cfg["scaling"]["fractions"]
            if not (r / SCALING_RUNS / fraction_name(f) / "stats.json").exists()
        )
        totals, train = _token_totals(r, cfg), cfg["train"]
        rate, basis, speed = _at_machine_speed(
            self, "training", r, cfg, lambda before: Train().expected_rate(cfg, before)
        )
        if totals is None or rate is None:
            return Estimate(None, basis if totals else NO_TOKENS)
        epochs = train["epochs"]
        tokens = totals["train"]["tokens"] * epochs * left
        return Estimate(
            tokens / rate,
            f"{left:g} x {epochs} epochs x {totals['train']['tokens']} "
            f"tokens at {rate:.0f} tok/s ({basis})",
            speed,
        )


# The stages in the workflow's order. Status also reads a results dir without Snakemake
# (--no-snakemake, a copied results dir, no workflow at hand), so their order, rules and
# outputs are listed here, in one place; tests/test_status.py checks them against the jobs
# of a Snakemake dry run.
# Some a config turns on (``enabled(cfg)``): ``run_stages`` are a config's.
STAGES: list[Stage] = [
    PrepareTarget(),
    StartDrafter(),
    PreparePrompts(),
    Generate(),
    VocabMap(),
    Extract(),
    Train(),
    Evaluate(),
    Scaling(),
]
_BY_NAME = {s.name: s for s in STAGES}


def run_stages(cfg: dict) -> list[Stage]:
    """The stages of ``cfg``'s workflow, in its order."""
    return [s for s in STAGES if s.enabled(cfg)]


def machine_speed(r: Path, cfg: dict) -> Machine:
    """This run's measurements of the machine, each beside the rate its estimate assumed."""
    measured = []
    for stage in STAGES:
        kind = stage.kind(cfg)
        found = stage.measured(r, cfg) if kind else None
        if found is not None:
            measured.append((stage, kind, found))
    starts = [m.started_at for _, _, m in measured if m.started_at]
    since = min(starts, key=_timestamp) if starts else None
    return Machine(
        [
            Speed(
                stage.name, kind, m.rate, stage.expected_rate(cfg, BENCHMARKS_ONLY)[0], m.elapsed_s
            )
            for stage, kind, m in measured
        ],
        since,
    )


def _at_machine_speed(
    stage: Stage,
    kind: str,
    r: Path,
    cfg: dict,
    lookup: Callable[[str | None], tuple[float | None, str]],
) -> tuple[float | None, str, Speed | None]:
    """The rate an estimate of ``kind`` work by ``stage`` rests on, its basis and the speed that
    scaled it: ``lookup(before)``, an earlier run's rate on this machine (the rates history
    before ``before``) as it is; else the benchmarks' times this machine's speed where
    another stage of this run measured one (:class:`Speed`); else ``lookup(None)`` as it
    is."""
    machine = machine_speed(r, cfg)
    rate, basis = lookup(machine.since)
    if rate is not None and getattr(basis, "here", False):
        # this machine already: scaled by nothing
        return rate, basis, None
    speed = machine.speed(kind, stage.name)
    if speed is not None and rate is not None:
        return rate * speed.factor, f"{basis}, {speed.says(kind)}", speed
    rate, basis = lookup(None)
    return rate, basis, None
