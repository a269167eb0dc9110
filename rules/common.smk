# Shared by all rule files, included first by the Snakefile. The validated config, the
# results dir, the shard lists, the software of each job and its resources.
import os
import sys

from eaglet.core.config import (
    eval_shard_count,
    outside_working_dir,
    previews_only,
    record_settings,
    stage_params,
    validate,
)
from eaglet.core import layout  # every results path, by name (layout.MANIFEST, ...)
from eaglet.core.cluster import ClusterError, job_threads, misfits, partitions
from eaglet.model.published import apply as start_settings
from eaglet.model.published import fingerprint as start_fingerprint
from eaglet.target.checkpoint import check_recorded_target, read_target

_validated = validate(config)
config.clear()
config.update(_validated)

R = config["results_dir"]
if outside_working_dir(R):
    logger.warning(outside_working_dir(R))
# train.init_from: the starting drafter decides the method, vocabulary and aux layers
START = config["train"]["init_from"]


def _target_config():
    """The prepared target's config.json, where it is prepared (None before)."""
    try:
        return f"{read_target(f'{R}/{layout.TARGET_JSON}')['path']}/config.json"
    except (OSError, ValueError, KeyError):
        return None


for _note in start_settings(config, f"{R}/{layout.START_DRAFTER}", _target_config()):
    logger.info(_note)
# settings the prepared target cannot honour stop here, before any stage runs
check_recorded_target(
    f"{R}/{layout.TARGET_JSON}",
    config["target"]["model"],
    config["vocab"]["draft_vocab_size"],
    config["extract"]["aux_layer_ids"],
)

# Software of every job, deployed with `--software-deployment-method conda` (runs from the
# .venv ignore it). Model stages get the vLLM GPU engine when any of them holds GPUs, else the
# CPU one; stages that run no model always get the CPU one. Paths are relative to rules/.
CPU_ENV = "../envs/cpu.yaml"
MODEL_ENV = (
    "../envs/gpu.yaml"
    if any(config[stage]["gpus"] for stage in ("server", "extract", "train"))
    else CPU_ENV
)

# Hidden-state shards: extract.num_shards for the training samples, extract.num_eval_shards
# for the held-out ones. train.data stream: the training samples' states go from the server to
# the trainer and are never stored; only the held-out shards are extracted.
STREAM = config["train"]["data"] == "stream"
TRAIN_SHARDS = [] if STREAM else [f"{i:05d}" for i in range(config["extract"]["num_shards"])]
EVAL_SHARDS = [f"{i:05d}" for i in range(eval_shard_count(config))]

# Outputs `all` asks for beyond the verdict's, each only when its stage is enabled.
OPTIONAL_TARGETS = [f"{R}/{layout.SCALING}"] if config["scaling"]["enabled"] else []


def hidden_files(split: str, suffix: str) -> list[str]:
    """Every shard file (``suffix`` .safetensors or .json) of ``split`` (train or eval)."""
    if split == "train":
        return [f"{R}/{layout.HIDDEN}/shard_{i}{suffix}" for i in TRAIN_SHARDS]
    return [f"{R}/{layout.HIDDEN_EVAL}/shard_{i}{suffix}" for i in EVAL_SHARDS]


def settings_file(stage: str, settings: dict) -> str:
    """The file, under the results, holding the settings ``stage``'s outputs were made with: an
    input of its jobs, rewritten when they change, so that the stage and every stage after it
    run again from any checkout (Snakemake's own records of params stay in the workflow
    directory, and a fresh clone or a copied results directory has none)."""
    path = f"{R}/{layout.RUN_SETTINGS}/{stage}.json"
    changed = record_settings(path, settings, write=not PREVIEW)
    if changed:
        logger.info(
            f"{stage}: settings changed since its outputs were made "
            f"({'; '.join(changed)}): it runs again, and what depends on it"
            + (
                " (a command that runs no job records nothing: the preview below "
                "shows the rerun only where Snakemake's own records do)"
                if PREVIEW
                else ""
            )
        )
    return path


# A dry run, summary, lint or report records no settings: run with another config, it would
# make the next real run rerun what that config changes (eaglet status runs a dry run).
PREVIEW = previews_only(sys.argv)


# generate.capture_hidden_states: the generation server saves every answer's hidden states
# where the vllm extraction rule packs them from.
CAPTURE = config["generate"]["capture_hidden_states"]
GENERATE_PARAMS = dict(
    target=config["target"],
    generate=stage_params(config, "generate"),
    **(
        {
            "capture": {
                "dir": f"{R}/{layout.CAPTURE_REQUESTS}",
                "aux_layer_ids": config["extract"]["aux_layer_ids"],
            }
        }
        if CAPTURE
        else {}
    ),
)


# Threads of a job that runs a model. Snakemake starts every job with OMP_NUM_THREADS (and
# MKL_NUM_THREADS, ...) set to its threads, 1 unless declared. So torch's training
# and HF extraction, and vLLM's CPU engine, computed on one core however many the run had.
# Locally a model job gets every core of the run (--cores; Snakemake runs nothing beside it).
# A cluster run has no --cores: its GPU jobs get the profile's cpus_per_gpu instead.
# Inside a SLURM job its own Snakemake runs with every core of the node: the job's threads
# are what SLURM gave it (eaglet.core.cluster.job_threads).
MODEL_THREADS = job_threads(workflow.resource_settings.cores)


def check_cluster_fit() -> None:
    """Submitting to SLURM: every stage's memory and time must fit a node of the partition it
    goes to (the profile routes the model stages to EAGLET_SLURM_GPU_PARTITION), else sbatch
    refuses each job in turn; say so before anything is submitted. Called when the run starts
    (the executor is known only then), not in dry runs or inside a job."""
    if getattr(workflow.executor_plugin, "name", None) != "slurm" or workflow.remote_exec:
        return
    parts = partitions()
    if not parts:
        return
    partition = os.environ.get("EAGLET_SLURM_PARTITION") or None
    model_partition = os.environ.get("EAGLET_SLURM_GPU_PARTITION") or partition
    problems = misfits(
        config["resources"], parts, {stage: model_partition for stage in config["resources"]}
    )
    if problems:
        raise ClusterError(
            "the cluster cannot run these jobs as the config sizes them:\n  "
            + "\n  ".join(problems)
            + "\nSet resources.<stage>.mem_mb and runtime (minutes) "
            "in your config to what the partition's nodes have (sinfo -o '%P %m %l %c' lists "
            "them), or send the jobs to a larger partition (EAGLET_SLURM_PARTITION, "
            "EAGLET_SLURM_GPU_PARTITION); nothing was submitted."
        )


def job_resources(stage: str, gpus: int) -> dict:
    """A job's resources: the GPUs it holds (the `gpu` resource Snakemake counts, so GPU stages
    never overlap beyond the GPUs there are) and its memory and time from resources.<stage>."""
    limits = config["resources"][stage]
    return dict(gpu=gpus, mem_mb=limits["mem_mb"], runtime=limits["runtime"])
