"""Where a run's results live: every path the rules write, named once, relative to the
results dir (``results_dir``).

The Snakefile's rules build their inputs and outputs from these names (``f"{R}/{MANIFEST}"``);
``eaglet status``, the report page, ``eaglet rehearse``, ``eaglet plan`` and the scaling stage
read the same names (``results / MANIFEST``). ``STAGE_FILES`` is the workflow's stage table:
each stage's rules, the outputs that show it finished, the progress files its jobs write and
its log, in the workflow's order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# -- the checkout ----------------------------------------------------------------------------

# the source checkout eaglet runs from (an editable install: `make install`); the benchmarks'
# results ship with it, not with the package
REPO = Path(__file__).resolve().parents[3]
BENCHMARK_RESULTS = REPO / "benchmarks" / "results"

# -- files, by stage -------------------------------------------------------------------------

TARGET_JSON = "target/target.json"

PROMPTS_TRAIN = "prompts/train.jsonl"
PROMPTS_EVAL = "prompts/eval.jsonl"
PROMPT_STATS = "prompts/stats.json"

SYNTHETIC_TRAIN = "synthetic/train.jsonl"
SYNTHETIC_EVAL = "synthetic/eval.jsonl"
SYNTHETIC_PARTIAL = "synthetic/generate.partial.jsonl"  # answers kept while generate runs
SYNTHETIC_STATS = "synthetic/stats.json"

VOCAB_MAP = "vocab/vocab_map.safetensors"
VOCAB_STATS = "vocab/stats.json"

HIDDEN = "hidden"  # the training samples' shards
HIDDEN_EVAL = "hidden/eval"  # the held-out samples' shards
MANIFEST = "hidden/manifest.json"
VLLM_WORK = "hidden/vllm"  # the vllm backend's request files and packed shards
CAPTURE_REQUESTS = "hidden/vllm/requests"  # what generation captured (capture_hidden_states)

DRAFTER = "drafter"
# train.init_from: the starting drafter in eaglet's export layout, and the record of its tensors
START_DRAFTER = "start_drafter"
START_DRAFTER_WEIGHTS = "start_drafter/model.safetensors"
START_RECORD_NAME = "start.json"
START_RECORD = f"{START_DRAFTER}/{START_RECORD_NAME}"
DRAFTER_WEIGHTS = "drafter/model.safetensors"
DRAFTER_CONFIG = "drafter/config.json"
DRAFTER_STATS = "drafter/stats.json"
TRAINING_LOG = "drafter/training_log.csv"
CHECKPOINTS = "drafter_checkpoints"

ACCEPTANCE = "eval/acceptance.json"
SERVE = "eval/serve.json"
SUMMARY = "eval/summary.csv"
PER_POSITION_PNG = "eval/per_position.png"
ACCEPTANCE_LENGTH_PNG = "eval/acceptance_length.png"
SPEEDUP_PNG = "eval/speedup.png"
TRAINING_CURVES_PNG = "eval/training_curves.png"
SCALING = "eval/scaling.json"
SCALING_RUNS = "scaling"  # scaling/<fraction>/: one subset's training

PROGRESS = "progress"
LOGS = "logs"

RUN_CONFIG = "run/config.json"  # the validated config of the run (`eaglet status`)
RUN_SNAKEMAKE = "run/snakemake.json"  # who runs it: pid and command
RUN_SETTINGS = "run/settings"  # per stage: the settings its outputs were made with


def progress_file(job: str) -> str:
    """A job's progress file: ``progress/<job>.json``."""
    return f"{PROGRESS}/{job}.json"


def log_file(job: str) -> str:
    """A job's log: ``logs/<job>.log``."""
    return f"{LOGS}/{job}.log"


def server_log(job: str) -> str:
    """The log of the vLLM server a job starts: ``logs/<job>.server.log``."""
    return f"{LOGS}/{job}.server.log"


# a hidden-state shard and its record (``.json``), in HIDDEN, HIDDEN_EVAL or the vllm backend's
# packed shards under VLLM_WORK
SHARD_GLOB = "shard_*"


def shard_name(index: int) -> str:
    """Shard ``index``'s file name: ``shard_00003.safetensors``."""
    return f"shard_{index:05d}.safetensors"


def fraction_name(fraction: float) -> str:
    """A fraction as its directory under scaling/ and its Snakemake wildcard (0.25, 0.5)."""
    return f"{fraction:g}"


# -- the stage table -------------------------------------------------------------------------


@dataclass(frozen=True)
class StageFiles:
    """One stage of the workflow as its files show it: the Snakemake rules that make it, the
    outputs that show it finished, the progress files its jobs write while they run (a glob),
    and its log (a file, or a directory of its jobs' logs)."""

    name: str
    rules: tuple[str, ...]
    outputs: tuple[str, ...]
    progress: str | None
    log: str


STAGE_FILES = {
    s.name: s
    for s in [
        StageFiles(
            "prepare_target", ("prepare_target",), (TARGET_JSON,), None, log_file("prepare_target")
        ),
        # a config turns it on (train.init_from): the published drafter a fine-tune starts from
        StageFiles(
            "start_drafter",
            ("start_drafter",),
            (START_DRAFTER_WEIGHTS, START_RECORD),
            None,
            log_file("start_drafter"),
        ),
        StageFiles(
            "prepare_prompts",
            ("prepare_prompts",),
            (PROMPTS_TRAIN, PROMPTS_EVAL),
            None,
            log_file("prepare_prompts"),
        ),
        StageFiles(
            "generate",
            ("generate",),
            (SYNTHETIC_TRAIN, SYNTHETIC_EVAL),
            progress_file("generate"),
            log_file("generate"),
        ),
        StageFiles("vocab_map", ("vocab_map",), (VOCAB_MAP,), None, log_file("vocab_map")),
        StageFiles(
            "extract",
            ("extract", "extract_all", "extract_vllm", "hidden_manifest"),
            (MANIFEST,),
            progress_file("extract_*"),
            f"{LOGS}/extract",
        ),
        StageFiles(
            "train", ("train",), (DRAFTER_WEIGHTS,), progress_file("train"), log_file("train")
        ),
        StageFiles(
            "evaluate",
            ("evaluate",),
            (ACCEPTANCE,),
            progress_file("evaluate"),
            log_file("evaluate"),
        ),
        # a config turns it on (scaling.enabled), after all of the above
        StageFiles(
            "scaling",
            ("scaling_train", "scaling"),
            (SCALING,),
            progress_file("scaling_*"),
            f"{LOGS}/scaling",
        ),
    ]
}
