# train.data stream: the job serves the target with the capture options of the vllm
# extraction backend and trains on the states as they come (eaglet.train_stream); it holds the
# server's GPUs and its own (train.gpus 0: the trainer shares the server's).
TRAIN_GPUS = config["train"]["gpus"] + (config["server"]["gpus"] if STREAM else 0)


rule train:
    """Train the EAGLE-3 drafter with training-time test and export it as vLLM loads it.
    Resumes from drafter_checkpoints/ after an interruption."""
    input:
        target=f"{R}/target/target.json",
        manifest=f"{R}/hidden/manifest.json",
        shards=hidden_files("train", ".safetensors"),
        eval_shards=hidden_files("eval", ".safetensors"),
        vocab=f"{R}/vocab/vocab_map.safetensors",
        **({"data": f"{R}/synthetic/train.jsonl"} if STREAM else {}),
    output:
        config=f"{R}/drafter/config.json",
        weights=f"{R}/drafter/model.safetensors",
        log_csv=report(
            f"{R}/drafter/training_log.csv",
            caption="../report/training_log.rst",
            category="Training",
        ),
    params:
        train=stage_params(config, "train", drop=("gpus",)),
        checkpoints=f"{R}/drafter_checkpoints",
        progress=f"{R}/progress/train.json",
        # stream: what the streamed states depend on, as the extraction's (rules/extract.smk),
        # and where the server saves them (the vllm extraction's, and capture's, directory)
        **({"stream": {**EXTRACT_PARAMS, "work": f"{R}/hidden/vllm"}} if STREAM else {}),
    threads: MODEL_THREADS
    resources:
        **job_resources("train", TRAIN_GPUS),
    log:
        f"{R}/logs/train.log",
        **({"server": f"{R}/logs/train.server.log"} if STREAM else {}),
    conda:
        MODEL_ENV
    script:
        "../scripts/train.py"
