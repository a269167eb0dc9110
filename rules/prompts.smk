from eaglet.prompts import local_files


rule prepare_prompts:
    """Read the prompt sources, deduplicate, and split into disjoint train/eval sets."""
    input:
        # the local prompt files: editing one reruns this stage and everything after it
        local_files(config["data"]),
    output:
        train=f"{R}/prompts/train.jsonl",
        eval=f"{R}/prompts/eval.jsonl",
        stats=f"{R}/prompts/stats.json",
    params:
        data=config["data"],
    log:
        f"{R}/logs/prepare_prompts.log",
    conda:
        CPU_ENV
    script:
        "../scripts/prepare_prompts.py"
