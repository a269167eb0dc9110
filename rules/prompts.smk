from eaglet.data.prompts import local_files


rule prepare_prompts:
    """Read the prompt sources, deduplicate, and split into disjoint train/eval sets."""
    input:
        # the local prompt files: editing one reruns this stage and everything after it
        local_files(config["data"]),
        settings=settings_file("prepare_prompts", {"data": config["data"]}),
    output:
        train=f"{R}/{layout.PROMPTS_TRAIN}",
        eval=f"{R}/{layout.PROMPTS_EVAL}",
        stats=f"{R}/{layout.PROMPT_STATS}",
    log:
        f"{R}/{layout.log_file('prepare_prompts')}",
    conda:
        CPU_ENV
    params:
        data=config["data"],
    script:
        "../scripts/prepare_prompts.py"
