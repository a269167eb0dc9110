# train.data stream: the job serves the target with the capture options of the vllm
# extraction backend and trains on the states as they come (eaglet.stages.train.stream); it
# holds the server's GPUs and its own (train.gpus 0: the trainer shares the server's).
TRAIN_GPUS = config["train"]["gpus"] + (config["server"]["gpus"] if STREAM else 0)
TRAIN_SETTINGS = dict(
    train=stage_params(config, "train", drop=("gpus",)),
    # stream: what the streamed states depend on, as the extraction's (rules/extract.smk)
    **({"stream": EXTRACT_PARAMS} if STREAM else {}),
)


if START:

    rule start_drafter:
        """train.init_from: the published drafter to start from, read in its own format,
        checked against the target and written in eaglet's export layout."""
        input:
            target=f"{R}/{layout.TARGET_JSON}",
            settings=settings_file("start_drafter", {"init_from": START}),
            # the files it names: another drafter put there starts the run over from it
            files=settings_file("start_drafter_files", start_fingerprint(START)),
        output:
            weights=f"{R}/{layout.START_DRAFTER_WEIGHTS}",
            record=f"{R}/{layout.START_RECORD}",
        log:
            f"{R}/{layout.log_file('start_drafter')}",
        conda:
            MODEL_ENV
        params:
            init_from=START,
            seed=config["train"]["seed"],
        script:
            "../scripts/start_drafter.py"


rule train:
    """Train the EAGLE-3 drafter with training-time test and export it as vLLM loads it.
    Resumes from drafter_checkpoints/ after an interruption."""
    input:
        # stream: the generated training answers, whose states the server makes as training
        # asks (** entries first: snakefmt puts them there, and would leave comments behind)
        **({"data": f"{R}/{layout.SYNTHETIC_TRAIN}"} if STREAM else {}),
        # train.init_from: the drafter rule start_drafter wrote, to fine-tune
        **({"start": f"{R}/{layout.START_DRAFTER_WEIGHTS}"} if START else {}),
        target=f"{R}/{layout.TARGET_JSON}",
        manifest=f"{R}/{layout.MANIFEST}",
        shards=hidden_files("train", ".safetensors"),
        eval_shards=hidden_files("eval", ".safetensors"),
        vocab=f"{R}/{layout.VOCAB_MAP}",
        settings=settings_file("train", TRAIN_SETTINGS),
    output:
        config=f"{R}/{layout.DRAFTER_CONFIG}",
        weights=f"{R}/{layout.DRAFTER_WEIGHTS}",
        log_csv=report(
            f"{R}/{layout.TRAINING_LOG}",
            caption="../report/training_log.rst",
            category="Training",
        ),
    log:
        f"{R}/{layout.log_file('train')}",
        **({"server": f"{R}/{layout.server_log('train')}"} if STREAM else {}),
    conda:
        MODEL_ENV
    threads: MODEL_THREADS
    resources:
        **job_resources("train", TRAIN_GPUS),
    params:
        # stream: what the streamed states depend on, as the extraction's (rules/extract.smk),
        # and where the server saves them (the vllm extraction's, and capture's, directory)
        **({"stream": {**EXTRACT_PARAMS, "work": f"{R}/{layout.VLLM_WORK}"}} if STREAM else {}),
        train=stage_params(config, "train", drop=("gpus",)),
        checkpoints=f"{R}/{layout.CHECKPOINTS}",
        progress=f"{R}/{layout.progress_file('train')}",
    script:
        "../scripts/train.py"
