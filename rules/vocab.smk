VOCAB_SETTINGS = {
    "draft_vocab_size": config["vocab"]["draft_vocab_size"],
    **({"init_from": START} if START else {}),
}


rule vocab_map:
    """Draft vocabulary: the most frequent completion tokens, as vLLM's d2t/t2d maps."""
    input:
        # train.init_from: the starting drafter's map is the run's
        **({"start": f"{R}/{layout.START_DRAFTER_WEIGHTS}"} if START else {}),
        target=f"{R}/{layout.TARGET_JSON}",
        data=f"{R}/{layout.SYNTHETIC_TRAIN}",
        settings=settings_file("vocab_map", VOCAB_SETTINGS),
    output:
        map=f"{R}/{layout.VOCAB_MAP}",
        stats=f"{R}/{layout.VOCAB_STATS}",
    log:
        f"{R}/{layout.log_file('vocab_map')}",
    conda:
        CPU_ENV
    params:
        draft_vocab_size=config["vocab"]["draft_vocab_size"],
    script:
        "../scripts/vocab_map.py"
