rule train:
    """Train the EAGLE-3 drafter with training-time test and export it as vLLM loads it.
    Resumes from drafter_checkpoints/ after an interruption."""
    input:
        target=f"{R}/target/target.json",
        manifest=f"{R}/hidden/manifest.json",
        shards=hidden_files("train", ".safetensors"),
        eval_shards=hidden_files("eval", ".safetensors"),
        vocab=f"{R}/vocab/vocab_map.safetensors",
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
    threads: MODEL_THREADS
    resources:
        **job_resources("train", config["train"]["gpus"]),
    log:
        f"{R}/logs/train.log",
    conda:
        MODEL_ENV
    script:
        "../scripts/train.py"
