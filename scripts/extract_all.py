"""Snakemake entry point of rule extract_all (extract.jobs: one): every shard of the training
and held-out samples from one job, the target loaded once."""

from eaglet.stages.extract.hf import ShardJob, run_shards
from eaglet.stages.scripting import run_stage

smk = snakemake  # noqa: F821 (injected by Snakemake)
cfg = {"extract": {**smk.config["extract"], **smk.params.extract}, "target": smk.params.target}
jobs = [
    ShardJob(data, len(files), i, shard, meta)
    for data, files, metas in (
        (smk.input.train, smk.output.shards, smk.output.metas),
        (smk.input.eval, smk.output.eval_shards, smk.output.eval_metas),
    )
    for i, (shard, meta) in enumerate(zip(files, metas))
]
run_stage(
    "extract",
    smk.log[0],
    lambda: run_shards(
        cfg, smk.input.target, jobs, progress_path=smk.params.progress, log_path=smk.log[0]
    ),
    gpus=smk.resources.get("gpu", 0),
)
