"""Snakemake entry point of rule prepare_prompts."""

from eaglet.data.prompts import prepare_prompts
from eaglet.stages.scripting import run_stage

smk = snakemake  # noqa: F821 (injected by Snakemake)
run_stage(
    "prepare_prompts",
    smk.log[0],
    lambda: prepare_prompts(smk.params.data, smk.output.train, smk.output.eval, smk.output.stats),
)
