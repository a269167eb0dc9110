"""Load and validate a run configuration against ``config_schema.yaml``.

Validation fills every default, so code downstream reads ``cfg["generate"]["concurrency"]``
without guarding. Errors name the offending key path and what the schema allows.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from eaglet.core import methods

if TYPE_CHECKING:
    import jsonschema


log = logging.getLogger("eaglet.core.config")


class ConfigError(ValueError):
    """A configuration key is unknown or has a value the schema does not allow."""


def schema() -> dict:
    text = resources.files("eaglet.core").joinpath("config_schema.yaml").read_text()
    return yaml.safe_load(text)


def _with_defaults(validator_class):
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, sched):
        if isinstance(instance, dict):
            for key, sub in properties.items():
                if "default" in sub and key not in instance:
                    instance[key] = copy.deepcopy(sub["default"])
        yield from validate_properties(validator, properties, instance, sched)

    import jsonschema

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


def _strict_integers(validator_class):
    """JSON Schema counts 2.0 as an integer; eaglet does not (``range(2.0)`` fails and
    ``--max-model-len 2048.0`` reaches the server as written)."""
    import jsonschema

    checker = validator_class.TYPE_CHECKER.redefine(
        "integer", lambda _, value: isinstance(value, int) and not isinstance(value, bool)
    )
    return jsonschema.validators.extend(validator_class, type_checker=checker)


@functools.cache
def _validator_class():
    """The validator, built on first use: jsonschema is imported only by code that validates,
    so modules that import this one for its helpers run where jsonschema is not installed
    (benchmarks/gpu_check.py on a bare GPU machine)."""
    import jsonschema

    return _with_defaults(_strict_integers(jsonschema.Draft202012Validator))


# Why a value the schema refuses cannot work, and what to set instead, by key (list indices
# left out of the path): the schema's own message says only what is allowed.
FIXES = {
    "extract.aux_layer_ids": (
        "aux layer ids start at 1: vLLM collects the state at the input of layer i as hidden "
        "+ residual, and its DeepSeek-V2/V3 model (DeepSeek, Kimi targets) has no residual at "
        "layer 0 and crashes (in the others id 0 is the bare token embedding); set "
        "extract.aux_layer_ids to ids from 1 to L-1 for a target of L decoder layers, or null "
        "for vLLM's default (2, L//2, L-3)"
    ),
}


def _describe(error: jsonschema.ValidationError) -> str:
    where = ".".join(str(p) for p in error.absolute_path) or "(top level)"
    fix = FIXES.get(".".join(str(p) for p in error.absolute_path if not isinstance(p, int)))
    if fix and error.validator == "minimum":
        return f"{where}: {error.message}: {fix}"
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed))
        return f"unknown key {', '.join(extra)!s} under {where}; allowed keys: {', '.join(allowed)}"
    if error.validator == "enum":
        return f"{where}: {error.instance!r} is not one of {error.validator_value}"
    if error.validator == "type":
        message = f"{where}: {error.instance!r} is not of type {error.validator_value}"
        if isinstance(error.instance, float) and error.instance.is_integer():
            message += f" (write {int(error.instance)}, without the decimal point)"
        return message
    return f"{where}: {error.message}"


def validate(config: dict[str, Any]) -> dict[str, Any]:
    """Return a validated copy of ``config`` with every default filled in. Settings that
    cannot work together are refused; CPU-only settings in a run on GPUs are logged as
    warnings (:func:`cpu_tunings_on_gpus`)."""
    # plain dicts and lists: Snakemake reads JSON config files into OrderedDicts, whose repr
    # would make every params-dependent rule look changed between a YAML and a JSON config
    cfg = _plain(config)
    errors = sorted(
        _validator_class()(schema()).iter_errors(cfg), key=lambda e: list(e.absolute_path)
    )
    if errors:
        lines = "\n  ".join(_describe(e) for e in errors)
        raise ConfigError(f"invalid configuration:\n  {lines}")
    # a second pass: defaults filled inside objects created by defaults
    errors = list(_validator_class()(schema()).iter_errors(cfg))
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(_describe(e) for e in errors))
    cfg["results_dir"] = results_dir(cfg["results_dir"])
    if cfg["generate"]["capture_hidden_states"] and cfg["server"]["url"]:
        raise ConfigError(
            "invalid configuration:\n  generate.capture_hidden_states needs the server eaglet "
            "starts with its capture options, but server.url names a running one: set "
            "server.url: null, or capture_hidden_states: false (extraction then runs as its "
            "own stage)"
        )
    if cfg["generate"]["capture_hidden_states"] and cfg["generate"]["temperature"] > 0:
        raise ConfigError(
            "invalid configuration:\n  generate.capture_hidden_states with generate.temperature "
            f"{cfg['generate']['temperature']}: vLLM captures through a speculative method "
            "(extract_hidden_states) that proposes each sampled token again as a draft, and "
            "with sampling its verification accepts them: the answers come back with tokens "
            "repeated ('TheTheThe user user as as'; vLLM 0.32, seen on the CPU engine, where "
            "the same server at temperature 0 answered exactly as without capture). Set "
            "generate.capture_hidden_states: false (extraction then prefills the answers as "
            "its own stage) or generate at temperature 0"
        )
    if cfg["train"]["data"] == "stream":
        stream_refusals(cfg)
    too_long = answers_past_context(cfg)
    if too_long:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(too_long))
    for warning in cpu_tunings_on_gpus(cfg):
        log.warning(warning)
    return cfg


def answers_past_context(cfg: dict[str, Any]) -> list[str]:
    """The ``max_tokens`` settings above ``target.max_model_len``: vLLM refuses every request
    that asks for more tokens than the context holds ("max_tokens=... cannot be greater than
    max_model_len=..."), so such a run would fail only after its server had started."""
    limit = cfg["target"]["max_model_len"]
    return [
        f"{section}.max_tokens {cfg[section]['max_tokens']} exceeds target.max_model_len "
        f"{limit}: vLLM refuses every request that asks for more tokens than the context "
        f"holds; lower {section}.max_tokens or raise target.max_model_len"
        for section in ("generate", "evaluate")
        if cfg[section]["max_tokens"] > limit
    ]


# Settings config.yaml makes for the CPU demo (its comments say why), by key: whether a value
# is that CPU tuning, and why it does not suit GPUs.
CPU_TUNINGS = {
    "target.dtype": (
        lambda v: v == "float32",
        "float32 is for CPUs without native bf16; on GPUs it doubles the target's memory and "
        "time: set bfloat16",
    ),
    "server.enforce_eager": (
        lambda v: v is True,
        "it saves the CPU server's graph compilation; on GPUs it gives up CUDA graphs, and "
        "decoding (and every speedup evaluation measures) slows: set false",
    ),
    "server.kv_cache_gib": (
        lambda v: v is not None,
        "a fixed size is for vLLM's CPU engine, which sizes memory from the first NUMA node; "
        "on GPUs it caps each GPU's KV cache whatever memory is free: set null",
    ),
    "evaluate.kv_cache_gib": (
        lambda v: v is not None,
        "the CPU demo gives its evaluation servers a small fixed size to fit side by side; on "
        "GPUs it caps each server's KV cache whatever memory is free: set null",
    ),
    "evaluate.interleave": (
        lambda v: v is True,
        "it starts every evaluation server at once, which suits small targets on CPUs; on "
        "GPUs each server needs the memory of a whole target: set auto (together only where "
        "they fit) or false",
    ),
}
# server.env variables with this prefix tune vLLM's CPU engine only
CPU_ENV_PREFIX = "VLLM_CPU_"


def cpu_tunings_on_gpus(cfg: dict[str, Any]) -> list[str]:
    """A warning, naming the key and its value, for each CPU-only setting in a config that
    gives GPUs (server.gpus, extract.gpus or train.gpus): a config copied from the CPU demo's
    config.yaml would carry them silently into a GPU run. Warnings, not errors: each still
    runs, only worse."""
    gpus = [
        f"{stage}.gpus {cfg[stage]['gpus']}"
        for stage in ("server", "extract", "train")
        if cfg[stage]["gpus"]
    ]
    if not gpus:
        return []
    found = [
        (key, lookup(cfg, key), why)
        for key, (is_cpu_tuning, why) in CPU_TUNINGS.items()
        if is_cpu_tuning(lookup(cfg, key))
    ]
    found += [
        (
            f"server.env.{name}",
            value,
            "VLLM_CPU_* variables tune vLLM's CPU engine and do nothing on GPUs: remove it",
        )
        for name, value in cfg["server"]["env"].items()
        if name.startswith(CPU_ENV_PREFIX)
    ]
    return [
        f"{key} is {value!r} in a run on GPUs ({', '.join(gpus)}): {why}"
        for key, value, why in found
    ]


def lookup(cfg: dict[str, Any], key: str) -> Any:
    """The value of a dotted ``key`` such as ``server.kv_cache_gib``."""
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


# Settings added after runs were made, with the value that reproduces those runs: a stage's
# params leave them out at that value, so that a run made before them is not redone.
ADDED_LATER = {
    "generate": {"capture_hidden_states": False, "chat_template_kwargs": None},
    "train": {
        "loss_on_prompt": False,
        "feature_noise": 0.0,
        "host_ram_mb": 4096,
        "prefetch_batches": None,
        "attention": "auto",
        "init_from": None,
        "drafter_attention": "llama",
        "method": methods.DEFAULT.name,
        "drafter_variant": methods.EAGLE3_LAYER.name,
        "data": "shards",
        "dflash_layers": 1,
        "stream_cache_gib": 0,
        "stream_ahead": None,
        "stream_kv_cache_gib": None,
        "stream_overlap": "auto",
    },
    "evaluate": {"compare_drafters": [], "top_p": 1.0, "top_k": 0, "mtp": True},
}


def eval_shard_count(cfg: dict[str, Any]) -> int:
    """``extract.num_eval_shards``, null resolved: held-out shards of about the training
    shards' size (the split's expected share of samples over theirs), at least one and no
    more than ``data.max_eval_prompts``."""
    ext, data = cfg["extract"], cfg["data"]
    if ext.get("num_eval_shards"):
        return ext["num_eval_shards"]
    share = data["eval_fraction"] / (1 - data["eval_fraction"])
    return max(1, min(round(ext["num_shards"] * share), data["max_eval_prompts"] or 1 << 30))


def stream_overlaps(setting, server_gpus: int, train_gpus: int, train_on_cpu: bool) -> bool:
    """Whether stream mode's server computes while the trainer trains
    (``train.stream_overlap``; :func:`eaglet.stages.train.stream.overlaps` resolves the trainer's
    device). auto: yes, unless the trainer computes on the server's own devices: the CPU's
    cores (a server without GPUs, a trainer on the CPU), or the server's GPUs (``train.gpus``
    0)."""
    if setting != "auto":
        return bool(setting)
    shared = not server_gpus if train_on_cpu else bool(server_gpus and not train_gpus)
    return not shared


def stream_refusals(cfg: dict[str, Any]) -> None:
    """``train.data: stream`` with settings it cannot serve."""
    problems = []
    if cfg["extract"]["backend"] != "vllm":
        problems.append(
            "train.data stream takes the states from the capture server of "
            f"extract.backend vllm, but extract.backend is "
            f"{cfg['extract']['backend']!r}: set extract.backend: vllm"
        )
    server = cfg["server"]
    if (
        server["gpus"]
        and not cfg["train"]["gpus"]
        and server["kv_cache_gib"] is None
        and cfg["train"]["stream_kv_cache_gib"] is None
    ):
        share = server["memory_utilization"]
        problems.append(
            "train.data stream with train.gpus 0 trains on the server's GPUs, but "
            "nothing bounds the server's KV cache there: vLLM would take "
            + (f"server.memory_utilization {share:g}" if share is not None else "its default 0.9")
            + " of each GPU and leave the training rank "
            "too little. Set train.stream_kv_cache_gib (the streaming job's server "
            "alone; `eaglet plan` prints a size that fits beside a training rank), "
            "or give training GPUs of its own (train.gpus)"
        )
    if cfg["scaling"]["enabled"]:
        problems.append(
            "scaling.enabled trains again on nested parts of the training shards, "
            "which train.data stream does not write: set scaling.enabled: false, "
            "or train.data: shards"
        )
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


# Settings that decide how a stage runs, never what it writes (how many requests at once,
# how long to wait, how often to log or keep a checkpoint): not in its rule's params or its
# settings file, so a changed one reruns nothing; the stage's script reads them from the
# config. A settings file written when they were recorded is read without them.
RUN_ONLY = {
    "generate": ("concurrency", "request_timeout_s", "max_retries"),
    "train": ("log_every", "checkpoint_every", "keep_checkpoints", "report_to"),
    "evaluate": ("request_timeout_s",),
}


def stage_params(cfg: dict[str, Any], section: str, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """``cfg[section]`` as a rule's params: without ``drop``, the :data:`RUN_ONLY` settings
    and the settings of :data:`ADDED_LATER` at their earlier behaviour."""
    later = ADDED_LATER.get(section, {})
    drop = (*drop, *RUN_ONLY.get(section, ()))
    return {
        k: v
        for k, v in cfg[section].items()
        if k not in drop and not (k in later and v == later[k])
    }


def without_run_only(settings: Any) -> Any:
    """A stage's recorded settings without the :data:`RUN_ONLY` ones (a file written when
    they were recorded: they say nothing of its outputs)."""
    if not isinstance(settings, dict):
        return settings
    return {
        section: (
            {k: v for k, v in value.items() if k not in RUN_ONLY[section]}
            if section in RUN_ONLY and isinstance(value, dict)
            else value
        )
        for section, value in settings.items()
    }


def results_dir(value: str) -> str:
    """``results_dir`` in the one spelling Snakemake matches targets against (``results/``,
    ``./results`` and ``x/../results`` are all ``results``); the filesystem root, an empty
    value (outputs at ``/target``, ``/prompts``, ...) and the working directory itself are
    refused."""
    fix = "set results_dir to a directory of its own, such as results"
    if not value.strip():
        raise ConfigError(
            f"invalid configuration:\n  results_dir is empty: every output would "
            f"go to the filesystem root (/target, /prompts, ...); {fix}"
        )
    normalized = os.path.normpath(value)
    absolute = os.path.abspath(normalized)
    if os.path.dirname(absolute) == absolute:
        raise ConfigError(
            f"invalid configuration:\n  results_dir {value!r} is the filesystem "
            f"root: outputs would go to /target, /prompts, ...; {fix}"
        )
    if absolute == os.getcwd():
        raise ConfigError(
            f"invalid configuration:\n  results_dir {value!r} is the working "
            f"directory itself: outputs would mix with the workflow's files; {fix}"
        )
    return normalized


def outside_working_dir(results: str) -> str | None:
    """A warning when ``results`` lies outside the working directory, else None."""
    relative = os.path.relpath(os.path.abspath(results))
    if relative != os.pardir and not relative.startswith(os.pardir + os.sep):
        return None
    return (
        f"results_dir {results} is outside the working directory {os.getcwd()}: every "
        f"output goes there; name targets the same way, e.g. "
        f"snakemake {results}/prompts/train.jsonl"
    )


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return copy.deepcopy(value)


def load(path: str) -> dict[str, Any]:
    with open(path) as handle:
        return validate(yaml.safe_load(handle) or {})


def load_run_config(results, config_path: str | None, workflow) -> dict:
    """A run's validated config, as `eaglet status` and `eaglet plan` read it: the run's own
    record (``results/run/config.json``), else ``config_path`` over the schema's defaults,
    else the workflow's config.yaml (as the Snakefile reads config.yaml only when no
    ``--configfile`` is given)."""
    try:
        recorded = json.loads((Path(results) / "run" / "config.json").read_text())
    except (OSError, ValueError):
        recorded = None
    if recorded is not None and config_path is None:
        return validate(recorded)
    if config_path:
        return validate(read_config_file(config_path))
    base_path = Path(workflow) / "config.yaml"
    return validate(read_config_file(base_path) if base_path.exists() else {})


def run_config_notes(results, config_path: str | None, cfg: dict) -> list[str]:
    """What a reader of ``cfg`` (as :func:`load_run_config` gave it) must know: a run record
    (``results/run/config.json``) that exists but cannot be read, so the settings came from
    elsewhere; a ``config_path`` whose settings differ from the run's own record."""
    path = Path(results) / "run" / "config.json"
    if not path.exists():
        return []
    try:
        recorded = validate(json.loads(path.read_text()))
    except (OSError, ValueError, ConfigError) as error:
        source = config_path or "the workflow's config.yaml"
        return [
            f"{path} cannot be read ({type(error).__name__}: {error}): the settings below "
            f"are {source}'s, which may not be this run's (the next snakemake run writes "
            f"the record again)"
        ]
    if config_path is None:
        return []
    changed = [line for line in differences(recorded, cfg) if not line.startswith("report")]
    if not changed:
        return []
    shown = "; ".join(changed[:6]) + (f"; and {len(changed) - 6} more" if len(changed) > 6 else "")
    return [
        f"the run in {results} was made with other settings than {config_path} "
        f"({shown}): the estimates follow {config_path}, as the next snakemake run with it "
        f"would (it reruns what those settings affect)"
    ]


def read_config_file(path) -> dict:
    """A config file's settings (not yet validated); a missing, unreadable or malformed file
    is a :class:`ConfigError` that names it and says what is wrong, never a traceback."""
    from pathlib import Path

    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as error:
        raise ConfigError(f"config file {path} cannot be read: {error.strerror}") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise ConfigError(
            f"config file {path} is not valid YAML{at}: {getattr(error, 'problem', None) or error}"
        ) from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(
            f"config file {path} holds a {type(loaded).__name__}, not a mapping "
            f"of settings (target:, generate:, ...)"
        )
    return loaded


def differences(was: Any, now: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two settings trees, as ``key: was -> now``."""
    if isinstance(was, dict) and isinstance(now, dict):
        return [
            line
            for key in sorted(set(was) | set(now), key=str)
            for line in differences(was.get(key), now.get(key), f"{prefix}{key}.")
        ]
    return [] if was == now else [f"{prefix.rstrip('.')}: {was!r} -> {now!r}"]


# Snakemake invocations that run no job: they must not record settings (a dry run with another
# config, `eaglet status --configfile other.yaml`, would make the next real run rerun stages)
PREVIEW_FLAGS = (
    "--dry-run",
    "--dryrun",
    "--dry_run",
    "--summary",
    "--detailed-summary",
    "--lint",
    "--list-rules",
    "--list",
    "--list-target-rules",
    "--dag",
    "--rulegraph",
    "--filegraph",
    "--d3dag",
    "--report",
    "--unlock",
    "--list-changes",
    "--lc",
    "--cleanup-metadata",
    "--printshellcmds-only",
)


def previews_only(argv: list[str]) -> bool:
    """Whether a Snakemake command line runs no job: a dry run (``-n``, ``-np``, ...), a
    summary, lint, graph, report or unlock."""
    for arg in argv[1:]:
        if arg in PREVIEW_FLAGS or arg.split("=")[0] in PREVIEW_FLAGS:
            return True
        if (
            arg.startswith("-")
            and not arg.startswith("--")
            and arg[1:].isalpha()
            and "n" in arg[1:]
        ):
            return True
    return False


def record_settings(
    path: str | os.PathLike, settings: dict[str, Any], write: bool = True
) -> list[str]:
    """Keep ``settings`` (what a stage's outputs depend on) in ``path``, a file every one of
    the stage's jobs takes as an input, and say what changed.

    Snakemake reruns a job whose settings changed only from its own records in the workflow
    directory's ``.snakemake/``, which another checkout, or a copied results directory, does
    not have: the outputs then stay as they were made, silently. This file lives with the
    results: rewritten when the settings differ from those it holds, it is newer than the
    stage's outputs, so Snakemake reruns the stage (and, through its outputs, every stage
    after it) from any checkout. Written the first time dated at the epoch: results made
    before it existed are taken as made with these settings, not rebuilt. Returns the
    differences (empty when nothing changed). ``write`` False (a command that runs no job):
    a file there already is not rewritten, the differences only are returned (a missing one
    is written, dated at the epoch: the jobs need it as an input). A file there that cannot
    be read (damaged, not JSON) says nothing of how the outputs were made: a run rewrites it
    now, so the stage runs again, and a command that runs no job leaves it."""
    path = Path(path)
    settings = json.loads(json.dumps(settings))  # as JSON holds them (tuples as lists)
    unreadable = None
    try:
        was = json.loads(path.read_text())
    except FileNotFoundError:
        was = None
    except (OSError, ValueError) as error:
        was, unreadable = None, f"{path.name} could not be read ({type(error).__name__})"
    was = without_run_only(was)
    if was == settings:
        return []
    if unreadable and not write:
        return [f"{unreadable}: the next run makes the stage again"]
    if not write and was is not None:
        return differences(was, settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(settings, indent=1, sort_keys=True) + "\n")
    if was is None and not unreadable:
        os.utime(tmp, (0, 0))
    os.replace(tmp, path)
    if unreadable:
        return [f"{unreadable}: the stage runs again"]
    return [] if was is None else differences(was, settings)
