"""Snakemake entry point of rule generate."""
from eaglet.generate import run_stage as generate_stage
from eaglet.scripting import run_stage

smk = snakemake  # noqa: F821 (injected by Snakemake)
cfg = {"target": smk.params.target, "generate": smk.params.generate,
       "server": smk.config["server"]}
run_stage("generate", smk.log.main, lambda: generate_stage(
    cfg, target_json=smk.input.target,
    prompts={"train": smk.input.train, "eval": smk.input.eval},
    outputs={"train": smk.output.train, "eval": smk.output.eval},
    stats_path=smk.output.stats, partial_path=smk.params.partial,
    progress_path=smk.params.progress, log_path=smk.log.main, server_log_path=smk.log.server))
