"""What ``eaglet status`` knows of one workflow stage (:class:`Stage`: its rules, outputs,
progress files and log, the facts its outputs record and their line, and a typical time), and
the stages that run no model and take a typical time: preparing the target and the prompts,
the published drafter a fine-tune starts from, and the draft vocabulary."""

from __future__ import annotations

import glob
import json
from pathlib import Path

from eaglet.core.layout import PROMPT_STATS, STAGE_FILES, START_RECORD, TARGET_JSON, VOCAB_STATS
from eaglet.tools.status.estimates import Estimate, Measurement, _pct, _read, measured_from_progress


class Stage:
    """Everything status knows of one stage: the Snakemake rules that make it, the outputs
    that show it finished, the progress files its jobs write while they run (a glob under
    the results dir), its log, the config key of the GPUs it holds, the facts its outputs
    record and their line in the report, and an estimate of the time it takes."""

    name: str  # its entry in layout.STAGE_FILES
    gpu_key: tuple[str, str] | None = None  # config section and key
    note: str = ""  # what the order line says of it
    typical_s: float | None = None
    # share of its units done before a running stage's own ETA is trusted over its estimate less
    # the time it has run (until then its rate carries the server start and the first units)
    settles_at: float = 0.25
    # whether the estimate of a running stage reads its progress (what the stage has decided
    # while it runs), not only the time it has run
    estimates_from_progress: bool = False

    def __init__(self) -> None:
        files = STAGE_FILES[self.name]
        self.rules, self.outputs, self.progress, self.log = (
            files.rules,
            files.outputs,
            files.progress,
            files.log,
        )

    def enabled(self, cfg: dict) -> bool:
        """Whether the config's workflow has the stage (most have it always)."""
        return True

    def gpus(self, cfg: dict) -> int | None:
        """GPUs the stage's jobs hold (None: it runs no model)."""
        if not self.gpu_key:
            return None
        section, key = self.gpu_key
        return cfg[section].get(key, 0)

    def facts(self, r: Path) -> dict:
        return {}

    def read_progress(self, r: Path, path: Path) -> dict | None:
        """One of the stage's progress files, as status shows it."""
        return _read(path)

    def line(self, f: dict) -> str:
        return json.dumps(f)

    def estimate(self, r: Path, cfg: dict, progress: dict | None) -> Estimate:
        """Time left when the stage is not running (a running one has its own ETA)."""
        return Estimate(self.typical_s, "typical")

    def kind(self, cfg: dict) -> str | None:
        """The kind of model work its rate measures (None: no model's)."""
        return None

    def expected_rate(self, cfg: dict, before: str | None = None) -> tuple[float | None, str]:
        """The tokens/s its estimate rests on and where it comes from; ``before``: the rates
        history as it was then."""
        return None, "no rate"

    def rate_files(self, r: Path, cfg: dict) -> list[str]:
        """The progress files that measure its rate."""
        return sorted(glob.glob(str(r / self.progress))) if self.progress else []

    def measured(self, r: Path, cfg: dict) -> Measurement | None:
        """Its rate in this run, where it has worked a minute or finished."""
        return measured_from_progress(self.rate_files(r, cfg))


class PrepareTarget(Stage):
    name = "prepare_target"

    def facts(self, r):
        t = _read(r / TARGET_JSON) or {}
        return {
            "model": t.get("spec"),
            "layers": t.get("num_hidden_layers"),
            "hidden_size": t.get("hidden_size"),
            "vocab_size": t.get("vocab_size"),
        }

    def line(self, f):
        return f"{f['model']}: {f['layers']} layers, hidden {f['hidden_size']}, vocab {f['vocab_size']}"

    def estimate(self, r, cfg, progress):
        return Estimate(40.0 if cfg["target"]["model"].startswith("embedded:") else 5.0, "typical")


class StartDrafter(Stage):
    """Optional (train.init_from): the published drafter a fine-tune starts from, read in its
    own format (a hub id is downloaded first), checked against the target and converted."""

    name = "start_drafter"
    typical_s = 20.0

    def enabled(self, cfg: dict) -> bool:
        return bool(cfg.get("train", {}).get("init_from"))

    def facts(self, r):
        s = _read(r / START_RECORD) or {}
        return {
            "source": s.get("source"),
            "format": s.get("format"),
            "method": s.get("method"),
            "from_drafter": len(s.get("from_drafter", [])),
            "new": len(s.get("new", [])),
        }

    def line(self, f):
        return (
            f"{f['source']} ({f['format']}, {f['method']}): {f['from_drafter']} tensors from "
            f"it, {f['new']} new"
        )

    def estimate(self, r, cfg, progress):
        where = str(cfg["train"]["init_from"])
        if Path(where).exists():
            return Estimate(self.typical_s, "typical")
        return Estimate(self.typical_s, "typical, and the download of a hub id not yet cached")


class PreparePrompts(Stage):
    name = "prepare_prompts"
    typical_s = 10.0

    def facts(self, r):
        s = _read(r / PROMPT_STATS) or {}
        totals = s.get("totals", {})
        return {
            "train_prompts": s.get("n_train"),
            "eval_prompts": s.get("n_eval"),
            "bad_rows": totals.get("bad"),
            "duplicates": totals.get("duplicates"),
        }

    def line(self, f):
        return (
            f"{f['train_prompts']} train / {f['eval_prompts']} eval prompts, "
            f"{f['bad_rows']} bad rows, {f['duplicates']} duplicates"
        )


class VocabMap(Stage):
    name = "vocab_map"
    typical_s = 10.0

    def facts(self, r):
        s = _read(r / VOCAB_STATS) or {}
        return {
            "draft_vocab_size": s.get("draft_vocab_size"),
            "coverage": s.get("coverage"),
            "distinct_tokens": s.get("distinct_completion_tokens"),
            "filled": s.get("filled"),
        }

    def line(self, f):
        return (
            f"Vd {f['draft_vocab_size']} covers {_pct(f['coverage'])} of completion tokens "
            f"({f['distinct_tokens']} distinct)"
        )
