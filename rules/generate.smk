rule generate:
    """Serve the target with vLLM and keep exactly what it answers to every prompt (the
    eval split too: its answers are the drafter's held-out set). Resumes from
    synthetic/generate.partial.jsonl after an interruption."""
    input:
        target=f"{R}/{layout.TARGET_JSON}",
        train=f"{R}/{layout.PROMPTS_TRAIN}",
        eval=f"{R}/{layout.PROMPTS_EVAL}",
        settings=settings_file("generate", GENERATE_PARAMS),
    output:
        train=f"{R}/{layout.SYNTHETIC_TRAIN}",
        eval=f"{R}/{layout.SYNTHETIC_EVAL}",
        stats=f"{R}/{layout.SYNTHETIC_STATS}",
    log:
        main=f"{R}/{layout.log_file('generate')}",
        server=f"{R}/{layout.server_log('generate')}",
    conda:
        MODEL_ENV
    threads: MODEL_THREADS
    resources:
        **job_resources("generate", config["server"]["gpus"]),
    params:
        # what changes the samples; server lifecycle settings are read from config
        **GENERATE_PARAMS,
        partial=f"{R}/{layout.SYNTHETIC_PARTIAL}",
        progress=f"{R}/{layout.progress_file('generate')}",
    script:
        "../scripts/generate.py"
