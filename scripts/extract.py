"""Snakemake entry point of rule extract (one shard of the training or held-out samples per job)."""

from eaglet.stages.extract.hf import run_shard
from eaglet.stages.scripting import run_stage

smk = snakemake  # noqa: F821 (injected by Snakemake)
cfg = {"extract": {**smk.config["extract"], **smk.params.extract}, "target": smk.params.target}
run_stage(
    "extract",
    smk.log[0],
    lambda: run_shard(
        cfg,
        smk.input.target,
        smk.input.data,
        index=int(smk.wildcards.i),
        num_shards=smk.params.num_shards,
        shard_path=smk.output.shard,
        meta_path=smk.output.meta,
        progress_path=smk.params.progress,
        log_path=smk.log[0],
    ),
    gpus=smk.resources.get("gpu", 0),
)
