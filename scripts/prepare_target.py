"""Snakemake entry point of rule prepare_target."""
from eaglet.scripting import run_stage
from eaglet.target import prepare_target

smk = snakemake  # noqa: F821 (injected by Snakemake)
run_stage("prepare_target", smk.log[0],
          lambda: prepare_target(smk.params.model, smk.params.out_dir))
