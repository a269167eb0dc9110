# eaglet: train an EAGLE-3 drafter for a target LLM and measure it in vLLM.
# Stages live in rules/*.smk, logic in src/eaglet; `snakemake -n` previews the plan.
from eaglet.config import outside_working_dir, stage_params, validate
from eaglet.target import check_recorded_target

configfile: "config.yaml"


report: "report/workflow.rst"

_validated = validate(config)
config.clear()
config.update(_validated)

R = config["results_dir"]
if outside_working_dir(R):
    logger.warning(outside_working_dir(R))
# settings the prepared target cannot honour stop here, before any stage runs
check_recorded_target(f"{R}/target/target.json", config["target"]["model"],
                      config["vocab"]["draft_vocab_size"], config["extract"]["aux_layer_ids"])

# Software of every job, deployed with `--software-deployment-method conda` (runs from the
# .venv ignore it): the vLLM GPU engine when any stage holds GPUs, else the CPU one. The path
# is relative to rules/, where the rules are defined.
ENV = (
    "../envs/gpu.yaml"
    if any(config[stage]["gpus"] for stage in ("server", "extract", "train"))
    else "../envs/cpu.yaml"
)


onstart:
    # what `eaglet status` reads: the validated config of this run and who runs it
    from eaglet.io import write_json
    import os, sys
    write_json(f"{R}/run/config.json", config)
    write_json(f"{R}/run/snakemake.json", {"pid": os.getpid(), "command": " ".join(sys.argv)})


include: "rules/target.smk"
include: "rules/prompts.smk"
include: "rules/generate.smk"
include: "rules/vocab.smk"
include: "rules/extract.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"


rule all:
    default_target: True
    input:
        f"{R}/eval/acceptance.json",
        f"{R}/eval/per_position.png",
        f"{R}/eval/acceptance_length.png",
        f"{R}/eval/speedup.png",
        f"{R}/eval/training_curves.png",
