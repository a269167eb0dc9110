"""Snakemake entry point of rule prepare_target."""
from eaglet.stages.scripting import run_stage
from eaglet.target.checkpoint import prepare_target

smk = snakemake  # noqa: F821 (injected by Snakemake)
# the settings checked against the target come from the config, not params: changing them
# must not redo this stage (and so everything after it); the Snakefile checks them too
run_stage("prepare_target", smk.log[0], lambda: prepare_target(
    smk.params.model, smk.params.out_dir,
    draft_vocab_size=smk.config["vocab"]["draft_vocab_size"],
    aux_layer_ids=smk.config["extract"]["aux_layer_ids"]))
