# eaglet: train an EAGLE-3 drafter for a target LLM and measure it in vLLM.
# Stages live in rules/*.smk, logic in src/eaglet; `snakemake -n` previews the plan.

# config.yaml is the CPU demo's own run (`make demo`). A run given --configfile is validated
# over the schema's defaults alone (src/eaglet/core/config_schema.yaml): merged over config.yaml,
# it would inherit the demo's CPU tunings (float32, a fixed KV cache, ...) without a word.
if not workflow.overwrite_configfiles:

    configfile: "config.yaml"


report: "report/workflow.rst"


include: "rules/common.smk"


# The report's first page and captions, written from this run's results: Snakemake renders
# report/*.rst with the config as all they get of the run (eaglet.tools.report_page).
from eaglet.tools.report_page import REPORT_KEY, report_texts

config[REPORT_KEY] = report_texts(R, config)


import time

RUN_STARTED = time.time()


onstart:
    check_cluster_fit()  # a cluster whose nodes cannot hold the jobs: nothing is submitted
    # what `eaglet status` reads: the validated config of this run and who runs it
    from eaglet.core.io import write_json
    import os, sys

    write_json(f"{R}/{layout.RUN_CONFIG}", {k: v for k, v in config.items() if k != REPORT_KEY})
    write_json(
        f"{R}/{layout.RUN_SNAKEMAKE}", {"pid": os.getpid(), "command": " ".join(sys.argv)}
    )


onerror:
    # a cluster job's real cause is in SLURM's log of it, which Snakemake does not show
    from eaglet.core.cluster import slurm_log_errors

    for line in slurm_log_errors(".", RUN_STARTED):
        logger.error(f"SLURM log of a failed job: {line}")


include: "rules/target.smk"
include: "rules/prompts.smk"
include: "rules/generate.smk"
include: "rules/vocab.smk"
include: "rules/extract.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"
include: "rules/scaling.smk"


rule all:
    default_target: True
    input:
        f"{R}/{layout.ACCEPTANCE}",
        f"{R}/{layout.PER_POSITION_PNG}",
        f"{R}/{layout.ACCEPTANCE_LENGTH_PNG}",
        f"{R}/{layout.SPEEDUP_PNG}",
        f"{R}/{layout.TRAINING_CURVES_PNG}",
        *OPTIONAL_TARGETS,
