# eaglet: train an EAGLE-3 drafter for a target LLM and measure it in vLLM.
# Stages live in rules/*.smk, logic in src/eaglet; `snakemake -n` previews the plan.
from eaglet.config import validate

configfile: "config.yaml"

_validated = validate(config)
config.clear()
config.update(_validated)

R = config["results_dir"]


include: "rules/target.smk"
include: "rules/prompts.smk"
include: "rules/generate.smk"
include: "rules/vocab.smk"
include: "rules/extract.smk"


rule all:
    default_target: True
    input:
        f"{R}/vocab/vocab_map.safetensors",
        f"{R}/hidden/manifest.json",
        f"{R}/hidden/eval/shard_00000.safetensors",
