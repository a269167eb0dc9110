rule prepare_target:
    """Resolve the target model; dequantize the embedded default into an HF directory."""
    input:
        settings=settings_file("prepare_target", {"model": config["target"]["model"]}),
    output:
        f"{R}/{layout.TARGET_JSON}",
    log:
        f"{R}/{layout.log_file('prepare_target')}",
    conda:
        CPU_ENV
    params:
        model=config["target"]["model"],
        out_dir=lambda wildcards, output: os.path.dirname(output[0]),
    script:
        "../scripts/prepare_target.py"
