rule generate:
    """Serve the target with vLLM and keep exactly what it answers to every prompt (the
    eval split too: its answers are the drafter's held-out set). Resumes from
    synthetic/generate.partial.jsonl after an interruption."""
    input:
        target=f"{R}/target/target.json",
        train=f"{R}/prompts/train.jsonl",
        eval=f"{R}/prompts/eval.jsonl",
    output:
        train=f"{R}/synthetic/train.jsonl",
        eval=f"{R}/synthetic/eval.jsonl",
        stats=f"{R}/synthetic/stats.json",
    params:
        # what changes the samples; server lifecycle settings are read from config
        target=config["target"],
        **GENERATE_PARAMS,
        partial=f"{R}/synthetic/generate.partial.jsonl",
        progress=f"{R}/progress/generate.json",
    threads: MODEL_THREADS
    resources:
        **job_resources("generate", config["server"]["gpus"]),
    log:
        main=f"{R}/logs/generate.log",
        server=f"{R}/logs/generate.server.log",
    conda:
        MODEL_ENV
    script:
        "../scripts/generate.py"
