rule generate:
    """Serve the target with vLLM and keep exactly what it answers to every training prompt.
    Resumes from synthetic/train.partial.jsonl after an interruption."""
    input:
        target=f"{R}/target/target.json",
        prompts=f"{R}/prompts/train.jsonl",
    output:
        data=f"{R}/synthetic/train.jsonl",
        stats=f"{R}/synthetic/stats.json",
    params:
        # what changes the samples; server lifecycle settings are read from config
        target=config["target"],
        generate=config["generate"],
        progress=f"{R}/progress/generate.json",
    resources:
        gpu=config["server"]["gpus"],
    log:
        main=f"{R}/logs/generate.log",
        server=f"{R}/logs/generate.server.log",
    script:
        "../scripts/generate.py"
