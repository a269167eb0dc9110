# Hidden states. Backend hf: one job per shard, extract.num_shards for the training samples,
# extract.num_eval_shards (usually one) for the held-out samples; with extract.jobs: one, a
# single job (one target load) writes them all. Backend vllm: one job (one server) writes
# the same files.
# generate.capture_hidden_states: generation saved the states already; the vllm rule packs
# them (and starts a server only for samples whose states are missing).
# Each job declares the GPUs it holds, so it never overlaps another GPU stage.
# What the states depend on (besides the samples): the server's and the requests' settings
# (timeouts, retries, port, memory share) are read from config by the scripts, so changing
# them reruns nothing.
EXTRACT_PARAMS = dict(
    # num_eval_shards: what it changes is which shard files there are
    extract={
        k: v
        for k, v in config["extract"].items()
        if k not in ("gpus", "device", "concurrency", "jobs", "num_eval_shards")
    },
    target=config["target"],
)
EXTRACT_SETTINGS = settings_file("extract", EXTRACT_PARAMS)
# The vocabulary stage stops a run whose draft vocabulary covers too little (vocab.min_coverage)
# before extraction spends its hours: the map is an input, so Snakemake runs that stage first,
# and an ancient one, so a map built again (the states do not depend on it) reruns nothing here.
VOCAB_FIRST = ancient(f"{R}/{layout.VOCAB_MAP}")
FROM_VLLM = config["extract"]["backend"] == "vllm" or CAPTURE
# backend vllm: the server holds the GPUs (server.gpus), for every shard at once
EXTRACT_RESOURCES = job_resources(
    "extract", config["server"]["gpus"] if FROM_VLLM else config["extract"]["gpus"]
)


if FROM_VLLM:

    rule extract_vllm:
        """Hidden states of every shard (train and held-out) from one vLLM server: each
        sequence is a prefill request whose states eaglet's connector saves. Finished
        requests and packed shards under hidden/vllm/ survive an interruption."""
        input:
            target=f"{R}/{layout.TARGET_JSON}",
            train=f"{R}/{layout.SYNTHETIC_TRAIN}",
            eval=f"{R}/{layout.SYNTHETIC_EVAL}",
            settings=EXTRACT_SETTINGS,
            vocab=VOCAB_FIRST,
        output:
            shards=hidden_files("train", ".safetensors"),
            metas=hidden_files("train", ".json"),
            eval_shards=hidden_files("eval", ".safetensors"),
            eval_metas=hidden_files("eval", ".json"),
        log:
            main=f"{R}/{layout.LOGS}/extract/vllm.log",
            server=f"{R}/{layout.server_log('extract/vllm')}",
        conda:
            MODEL_ENV
        threads: MODEL_THREADS
        resources:
            **EXTRACT_RESOURCES,
        params:
            **EXTRACT_PARAMS,
            work=f"{R}/{layout.VLLM_WORK}",
            progress=f"{R}/{layout.progress_file('extract_vllm')}",
        script:
            "../scripts/extract_vllm.py"

elif config["extract"]["jobs"] == "one":

    rule extract_all:
        """Hidden states of every shard (train and held-out) from one job: the target loaded
        once, each shard checked and written while the next one runs through it."""
        input:
            target=f"{R}/{layout.TARGET_JSON}",
            train=f"{R}/{layout.SYNTHETIC_TRAIN}",
            eval=f"{R}/{layout.SYNTHETIC_EVAL}",
            settings=EXTRACT_SETTINGS,
            vocab=VOCAB_FIRST,
        output:
            shards=hidden_files("train", ".safetensors"),
            metas=hidden_files("train", ".json"),
            eval_shards=hidden_files("eval", ".safetensors"),
            eval_metas=hidden_files("eval", ".json"),
        log:
            f"{R}/{layout.LOGS}/extract/all.log",
        conda:
            MODEL_ENV
        threads: MODEL_THREADS
        resources:
            **EXTRACT_RESOURCES,
        params:
            **EXTRACT_PARAMS,
            progress=f"{R}/{layout.progress_file('extract_all')}",
        script:
            "../scripts/extract_all.py"

else:

    rule extract:
        """Hidden states of shard {wildcards.i} of the training samples (split "") or of the
        held-out samples (split "eval/", the drafter's validation set)."""
        input:
            target=f"{R}/{layout.TARGET_JSON}",
            data=lambda w: f"{R}/{layout.SYNTHETIC_EVAL if w.split else layout.SYNTHETIC_TRAIN}",
            settings=EXTRACT_SETTINGS,
            vocab=VOCAB_FIRST,
        output:
            shard=f"{R}/{layout.HIDDEN}/{{split}}shard_{{i}}.safetensors",
            meta=f"{R}/{layout.HIDDEN}/{{split}}shard_{{i}}.json",
        log:
            f"{R}/{layout.LOGS}/extract/{{split}}shard_{{i}}.log",
        wildcard_constraints:
            split=r"(eval/)?",
            i=r"\d{5}",
        conda:
            MODEL_ENV
        threads: MODEL_THREADS
        resources:
            **EXTRACT_RESOURCES,
        params:
            **EXTRACT_PARAMS,
            num_shards=lambda w: len(EVAL_SHARDS if w.split else TRAIN_SHARDS),
            # the held-out split's first shard keeps the name it had as the only one
            progress=lambda w: f"{R}/{layout.PROGRESS}/extract_"
            + (w.i if not w.split else "eval" if w.i == "00000" else f"eval_{w.i}")
            + ".json",
        script:
            "../scripts/extract.py"


rule hidden_manifest:
    """Verify every shard, the held-out one too (hash, layers, dtype, target), re-extract any
    that fail, and list them with their sha256 and teacher agreement."""
    input:
        target=f"{R}/{layout.TARGET_JSON}",
        data=f"{R}/{layout.SYNTHETIC_TRAIN}",
        shards=hidden_files("train", ".safetensors"),
        metas=hidden_files("train", ".json"),
        eval_data=f"{R}/{layout.SYNTHETIC_EVAL}",
        eval_shards=hidden_files("eval", ".safetensors"),
        eval_metas=hidden_files("eval", ".json"),
    output:
        f"{R}/{layout.MANIFEST}",
    log:
        f"{R}/{layout.log_file('hidden_manifest')}",
    conda:
        MODEL_ENV
    threads: MODEL_THREADS
    resources:
        **EXTRACT_RESOURCES,
    params:
        **EXTRACT_PARAMS,
        num_shards=len(TRAIN_SHARDS),
        hidden_dir=lambda wildcards, output: os.path.dirname(output[0]),
    script:
        "../scripts/hidden_manifest.py"
