"""Validation of run configurations against ``config_schema.yaml`` (``eaglet.core.config``)."""

from __future__ import annotations

import copy
import logging
import subprocess
from pathlib import Path

import pytest
import yaml

from eaglet.core.config import (
    ADDED_LATER,
    RUN_ONLY,
    ConfigError,
    cpu_tunings_on_gpus,
    eval_shard_count,
    load,
    schema,
    stage_params,
    validate,
)
from tests.helpers.paths import REPO, SNAKEMAKE


def config_error(config: dict) -> str:
    """The message of the ConfigError that validating ``config`` raises."""
    with pytest.raises(ConfigError) as info:
        validate(config)
    return str(info.value)


def defaulted_paths(properties: dict, prefix: str = "") -> list[str]:
    """Dotted paths of every schema key with a default, nested objects included."""
    paths = []
    for key, sub in properties.items():
        path = prefix + key
        if "default" in sub:
            paths.append(path)
        paths += defaulted_paths(sub.get("properties", {}), path + ".")
    return paths


def lookup(cfg: dict, path: str):
    for key in path.split("."):
        cfg = cfg[key]
    return cfg


# -- valid configurations --------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["config.yaml", "tests/configs/tiny.yaml", "configs/cpu-large.yaml"]
)
def test_repo_configs_validate(path):
    cfg = load(str(REPO / path))

    assert set(cfg) == set(schema()["properties"])  # every section, filled with defaults


def test_repo_config_values_survive_validation():
    cfg = load(str(REPO / "config.yaml"))

    assert cfg["server"]["kv_cache_gib"] == 2 and cfg["evaluate"]["kv_cache_gib"] == 0.5
    assert cfg["generate"]["max_tokens"] == 256  # not the schema's default of 512


def test_empty_config_gets_every_default():
    cfg = validate({})

    for path in defaulted_paths(schema()["properties"]):
        lookup(cfg, path)  # KeyError if a default was not filled
    assert cfg["results_dir"] == "results"
    assert cfg["target"]["dtype"] == "bfloat16"
    assert cfg["server"]["port"] == 0
    assert cfg["server"]["extra_args"] == []
    assert cfg["generate"]["concurrency"] == 32
    assert cfg["generate"]["max_tokens"] == 512
    assert cfg["data"]["eval_fraction"] == 0.1
    # the default source, with the defaults of the source schema filled in as well
    assert [source["type"] for source in cfg["data"]["sources"]] == ["humaneval"]


def test_given_values_are_kept_and_siblings_defaulted():
    cfg = validate({"generate": {"concurrency": 4}, "server": {"port": 8123}})

    assert cfg["generate"]["concurrency"] == 4
    assert cfg["generate"]["temperature"] == 0.0
    assert cfg["server"]["port"] == 8123
    assert cfg["server"]["enforce_eager"] is False


def test_source_defaults_are_filled():
    cfg = validate({"data": {"sources": [{"type": "hf", "name": "org/set", "text_field": "q"}]}})

    assert cfg["data"]["sources"] == [
        {
            "type": "hf",
            "name": "org/set",
            "text_field": "q",
            "split": "train",
            "role_field": "role",
            "content_field": "content",
            "max_turns": 1,
        }
    ]


def test_validate_does_not_mutate_its_input():
    config = {"generate": {"concurrency": 4}, "data": {"sources": [{"type": "humaneval"}]}}
    original = copy.deepcopy(config)

    validate(config)

    assert config == original


# -- the schema's defaults are for GPUs; config.yaml holds the CPU demo's settings -----------


def with_gpus(config: dict) -> dict:
    config = copy.deepcopy(config)
    config.setdefault("server", {})["gpus"] = 1
    return config


def test_schema_defaults_carry_no_cpu_tuning():
    """A GPU run that names none of them starts from bfloat16, CUDA graphs, vLLM's own KV
    cache sizing, and evaluation servers started together only where they fit."""
    cfg = validate({"server": {"gpus": 1}})
    assert cpu_tunings_on_gpus(cfg) == []
    assert (cfg["target"]["dtype"], cfg["server"]["enforce_eager"]) == ("bfloat16", False)
    assert cfg["server"]["kv_cache_gib"] is None and cfg["server"]["env"] == {}
    assert cfg["evaluate"]["interleave"] is not True and cfg["train"]["layer_init"] == "random"


def test_every_cpu_tuning_of_config_yaml_is_named_with_its_value_in_a_gpu_run(caplog):
    demo = yaml.safe_load((REPO / "config.yaml").read_text())
    with caplog.at_level(logging.WARNING, logger="eaglet.core.config"):
        validate(with_gpus(demo))
    for key, value in [
        ("target.dtype", "'float32'"),
        ("server.enforce_eager", "True"),
        ("server.kv_cache_gib", "2"),
        ("evaluate.kv_cache_gib", "0.5"),
        ("server.env.VLLM_CPU_NUM_OF_RESERVED_CPU", "'0'"),
        ("evaluate.interleave", "True"),
    ]:
        assert f"{key} is {value} in a run on GPUs (server.gpus 1)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eaglet.core.config"):
        cfg = validate(demo)  # on the CPU they are what the demo needs: no word
    assert caplog.text == "" and cfg["target"]["dtype"] == "float32"


def test_cpu_tunings_are_warned_about_whichever_stage_holds_gpus():
    config = {"target": {"dtype": "float32"}, "server": {"env": {"NCCL_DEBUG": "INFO"}}}
    assert cpu_tunings_on_gpus(validate(config)) == []
    for stage in ("extract", "train"):
        [warning] = cpu_tunings_on_gpus(validate({**config, stage: {"gpus": 2}}))
        assert warning.startswith(f"target.dtype is 'float32' in a run on GPUs ({stage}.gpus 2)")
        assert "set bfloat16" in warning  # the fix; NCCL_DEBUG is no CPU tuning


@pytest.mark.parametrize(
    "path, needs",
    [
        (
            "configs/cpu-large.yaml",
            {
                "target.dtype": "float32",
                "server.enforce_eager": True,
                "server.kv_cache_gib": 2,
                "evaluate.kv_cache_gib": 0.5,
                "evaluate.interleave": True,
                "train.layer_init": "target",
                "train.loss_on_prompt": True,
                "extract.max_len": 2048,
            },
        ),
        (
            "tests/configs/tiny.yaml",
            {
                "target.dtype": "float32",
                "server.enforce_eager": True,
                "server.kv_cache_gib": 0.5,
                "train.layer_init": "target",
                "train.loss_on_prompt": True,
            },
        ),
    ],
)
def test_configs_given_with_configfile_state_the_cpu_settings_they_need(path, needs):
    """They are validated over the schema's defaults, not merged over config.yaml."""
    cfg = load(str(REPO / path))
    assert {key: lookup(cfg, key) for key in needs} == needs
    assert cfg["server"]["env"] == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


# -- invalid configurations ------------------------------------------------------------------


def test_unknown_top_level_key_names_it_and_the_allowed_keys():
    message = config_error({"bogus": 1})

    assert "unknown key bogus under (top level)" in message
    assert "allowed keys: " + ", ".join(sorted(schema()["properties"])) in message


def test_unknown_nested_key_names_it_and_the_allowed_keys():
    message = config_error({"generate": {"temprature": 0.5}})

    assert "unknown key temprature under generate" in message
    allowed = message.split("allowed keys:", 1)[1]
    assert "temperature" in allowed and "concurrency" in allowed


def test_bad_enum_names_the_allowed_values():
    message = config_error({"target": {"dtype": "fp64"}})

    assert "target.dtype" in message and "'fp64'" in message
    for value in ("auto", "float32", "bfloat16", "float16"):
        assert value in message


def test_bad_type_names_the_key_path():
    message = config_error({"generate": {"concurrency": "many"}})

    assert "generate.concurrency: 'many' is not of type integer" in message


@pytest.mark.parametrize(
    ("config", "path", "value"),
    [
        ({"extract": {"num_shards": 2.0}}, "extract.num_shards", "2.0"),
        ({"target": {"max_model_len": 2048.0}}, "target.max_model_len", "2048.0"),
        ({"extract": {"aux_layer_ids": [2, 15.0, 27]}}, "extract.aux_layer_ids.1", "15.0"),
    ],
)
def test_whole_number_floats_are_not_counts(config, path, value):
    """YAML reads 2.0 as a float: as a count it crashed extract.smk with a TypeError naming
    no key, and reached the server as --max-model-len 2048.0."""
    message = config_error(config)
    assert f"{path}: {value} is not of type integer" in message
    assert f"write {value[:-2]}" in message


def test_out_of_range_value_names_the_key_path():
    message = config_error({"generate": {"concurrency": 0}})

    assert "generate.concurrency" in message and "minimum" in message


@pytest.mark.parametrize(
    ("config", "path"),
    [
        ({"server": {"port": 70000}}, "server.port"),
        ({"server": {"memory_utilization": 0}}, "server.memory_utilization"),
        ({"server": {"kv_cache_gib": 0}}, "server.kv_cache_gib"),
        ({"data": {"eval_fraction": 1}}, "data.eval_fraction"),
        ({"data": {"sources": []}}, "data.sources"),
    ],
)
def test_range_limits_of_other_keys(config, path):
    assert path in config_error(config)


def test_aux_layer_id_0_is_refused_with_the_reason_and_the_fix():
    """vLLM's DeepSeek-V2/V3 model (DeepSeek, Kimi targets) collects hidden + residual at a
    layer's input and has no residual at layer 0: id 0 crashes it."""
    message = config_error({"extract": {"aux_layer_ids": [0, 15, 27]}})
    assert "extract.aux_layer_ids.0: 0 is less than the minimum of 1" in message
    assert "no residual at layer 0" in message and "ids from 1 to L-1" in message
    assert validate({"extract": {"aux_layer_ids": [1, 15, 27]}})["extract"]["aux_layer_ids"] == [
        1,
        15,
        27,
    ]


@pytest.mark.parametrize("section", ["generate", "evaluate"])
def test_max_tokens_past_the_context_is_refused(section):
    """vLLM refuses every request whose max_tokens exceeds max_model_len, after the server
    has started: refused before any stage runs."""
    message = config_error({"target": {"max_model_len": 1024}, section: {"max_tokens": 1025}})
    assert (
        f"{section}.max_tokens 1025 exceeds target.max_model_len 1024" in message
        and f"lower {section}.max_tokens or raise target.max_model_len" in message
    )
    validate({"target": {"max_model_len": 1024}, section: {"max_tokens": 1024}})


def test_unknown_key_in_a_data_source_is_rejected():
    message = config_error({"data": {"sources": [{"type": "file", "pth": "x.jsonl"}]}})

    assert "unknown key pth under data.sources.0" in message
    assert "path" in message.split("allowed keys:", 1)[1]


def test_data_source_needs_a_known_type():
    assert "data.sources.0" in config_error({"data": {"sources": [{"path": "x.jsonl"}]}})
    assert "'csv'" in config_error({"data": {"sources": [{"type": "csv"}]}})


def test_every_error_is_reported_at_once():
    message = config_error({"bogus": 1, "generate": {"concurrency": 0}})

    assert "bogus" in message and "generate.concurrency" in message


# -- the Snakefile validates -----------------------------------------------------------------


def snakemake_dry_run(tmp_path, config: dict) -> subprocess.CompletedProcess:
    configfile = tmp_path / "config.yaml"
    configfile.write_text(yaml.safe_dump(config))
    return subprocess.run(
        [
            str(SNAKEMAKE),
            "-n",
            "--cores",
            "1",
            "--configfile",
            str(configfile),
            "--config",
            f"results_dir={tmp_path / 'results'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.subprocess
def test_snakefile_rejects_an_unknown_key(tmp_path):
    run = snakemake_dry_run(tmp_path, {"generate": {"temprature": 0.5}})

    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    assert "ConfigError" in output
    assert "unknown key temprature under generate" in output


@pytest.mark.subprocess
def test_snakefile_accepts_a_valid_config(tmp_path):
    run = snakemake_dry_run(tmp_path, {"generate": {"temperature": 0.5}})

    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.subprocess
def test_snakefile_reads_config_yaml_only_without_a_configfile(tmp_path):
    """A --configfile run is validated over the schema's defaults: none of config.yaml's CPU
    tunings reach a GPU run. Without one (make demo), config.yaml is the run."""
    own = snakemake_dry_run(tmp_path, {"server": {"gpus": 1}, "evaluate": {"interleave": True}})
    output = own.stdout + own.stderr
    assert own.returncode == 0, output
    assert "evaluate.interleave is True in a run on GPUs" in output  # the warning is shown
    assert "target.dtype is 'float32'" not in output and "kv_cache_gib is" not in output
    assert "data/everyday_prompts.jsonl" not in output  # config.yaml's evaluate.prompt_sets
    demo = subprocess.run(
        [str(SNAKEMAKE), "-n", "--cores", "1", "--config", f"results_dir={tmp_path / 'demo'}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = demo.stdout + demo.stderr
    assert demo.returncode == 0, output
    assert "data/everyday_prompts.jsonl" in output


def test_validated_config_is_plain_whatever_the_file_format():
    """Snakemake reads JSON config files into OrderedDicts; rule params built from them must
    repr the same as from YAML, or Snakemake sees changed params and reruns finished stages."""
    from collections import OrderedDict

    as_yaml = {"data": {"sources": [{"type": "humaneval", "tasks": ["complete"]}]}}
    as_json = OrderedDict(
        data=OrderedDict(sources=[OrderedDict(type="humaneval", tasks=["complete"])])
    )
    plain, ordered = validate(as_yaml), validate(as_json)
    assert repr(ordered) == repr(plain)
    assert type(ordered["data"]["sources"][0]) is dict


# -- results_dir -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, problem",
    [
        ("", "is empty"),
        ("  ", "is empty"),
        ("/", "is the filesystem root"),
        ("//", "is the filesystem root"),
        ("/tmp/..", "is the filesystem root"),
        (".", "is the working directory itself"),
    ],
)
def test_results_dir_that_would_scatter_outputs_is_refused(value, problem):
    message = config_error({"results_dir": value})
    assert "results_dir" in message and problem in message
    assert "such as results" in message  # the fix


@pytest.mark.parametrize(
    "value, spelled",
    [
        ("results/", "results"),
        ("./results", "results"),
        ("x/../results-2", "results-2"),
        ("/tmp//run1/", "/tmp/run1"),
    ],
)
def test_results_dir_is_spelled_as_snakemake_matches_targets(value, spelled):
    assert validate({"results_dir": value})["results_dir"] == spelled


def test_results_dir_outside_the_working_directory_is_named_with_its_targets():
    from eaglet.core.config import outside_working_dir

    assert outside_working_dir("results") is None and outside_working_dir("a/b") is None
    warning = outside_working_dir("../elsewhere")
    assert "outside the working directory" in warning
    assert "snakemake ../elsewhere/prompts/train.jsonl" in warning


def dry_run_with_results_dir(tmp_path, value: str, *targets: str) -> subprocess.CompletedProcess:
    configfile = tmp_path / "config.yaml"
    configfile.write_text(yaml.safe_dump({"results_dir": value}))
    return subprocess.run(
        [str(SNAKEMAKE), *targets, "-n", "--cores", "1", "--configfile", str(configfile)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.subprocess
@pytest.mark.parametrize("value", ["", "/"])
def test_snakefile_refuses_an_empty_or_root_results_dir(tmp_path, value):
    run = dry_run_with_results_dir(tmp_path, value)
    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    assert "results_dir" in output and "such as results" in output
    assert "/target/target.json" not in output  # nothing planned at the root


@pytest.mark.subprocess
def test_snakefile_targets_stay_addressable_with_a_trailing_slash(tmp_path):
    results = tmp_path / "out"
    run = dry_run_with_results_dir(tmp_path, f"{results}/", f"{results}/prompts/train.jsonl")
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "rule prepare_prompts" in output and "rule generate" not in output


def test_settings_added_later_leave_the_params_of_earlier_runs_unchanged():
    """A run made before capture_hidden_states / loss_on_prompt / feature_noise / attention existed recorded params
    without them: at the value that reproduces it they are left out (no rerun of hours of
    generation or training), and set to anything else they count."""
    cfg = validate({"train": {"gpus": 2}})
    before = {
        k: v
        for k, v in cfg["train"].items()
        if k != "gpus" and k not in ADDED_LATER["train"] and k not in RUN_ONLY["train"]
    }
    assert {"loss_on_prompt", "method", "drafter_variant"} <= set(ADDED_LATER["train"])
    assert stage_params(cfg, "train", drop=("gpus",)) == before
    assert "capture_hidden_states" not in stage_params(cfg, "generate")
    cfg = validate(
        {
            "train": {"loss_on_prompt": True, "feature_noise": 0.2, "attention": "eager"},
            "generate": {"capture_hidden_states": True},
        }
    )
    assert stage_params(cfg, "train")["attention"] == "eager"  # the script must get it
    assert stage_params(cfg, "train")["loss_on_prompt"] is True
    assert stage_params(cfg, "train")["feature_noise"] == 0.2
    assert stage_params(validate({"train": {"host_ram_mb": 999}}), "train")["host_ram_mb"] == 999
    assert stage_params(cfg, "generate")["capture_hidden_states"] is True


def test_capture_during_sampled_generation_is_refused_naming_both_fixes():
    message = config_error({"generate": {"capture_hidden_states": True, "temperature": 1.0}})
    assert "repeated" in message
    assert "capture_hidden_states: false" in message and "temperature 0" in message
    # greedy generation captures as before
    assert validate({"generate": {"capture_hidden_states": True}})["generate"]["temperature"] == 0


@pytest.mark.parametrize(
    "extract, data, count",
    [
        ({}, {}, 1),  # 4 x 0.1 / 0.9 = 0.44
        ({"num_shards": 64}, {"eval_fraction": 0.1}, 7),  # shards of the training ones' size
        ({"num_shards": 64}, {"eval_fraction": 0.02}, 1),  # configs/kimi-k2.5.yaml: 1.31
        ({"num_shards": 64}, {"eval_fraction": 0.1, "max_eval_prompts": 3}, 3),
        ({"num_shards": 64, "num_eval_shards": 2}, {}, 2),  # as set
    ],
)
def test_the_held_out_split_is_sharded_like_the_training_split(extract, data, count):
    assert eval_shard_count(validate({"extract": extract, "data": data})) == count


@pytest.mark.subprocess
@pytest.mark.parametrize("backend, rule", [("vllm", "extract_vllm"), ("hf", "extract")])
def test_the_workflow_extracts_every_held_out_shard_the_config_asks_for(tmp_path, backend, rule):
    """extract.num_eval_shards 2: both held-out shards extracted (by the one vllm job, or a
    hf job each), and the manifest (and so training) reads both."""
    from tests.workflows.dryrun import parse_dry_run

    configfile = tmp_path / "config.yaml"
    configfile.write_text(
        yaml.safe_dump(
            {
                "results_dir": str(tmp_path / "run"),
                "extract": {"num_eval_shards": 2, "backend": backend},
            }
        )
    )
    run = subprocess.run(
        [
            str(SNAKEMAKE),
            str(tmp_path / "run" / "hidden" / "manifest.json"),
            "-n",
            "--cores",
            "1",
            "--configfile",
            str(configfile),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    jobs = parse_dry_run(run.stdout)
    held_out = sorted(
        o
        for j in jobs
        if j.rule == rule
        for o in j.output
        if "/eval/" in o and o.endswith(".safetensors")
    )
    assert [Path(o).name for o in held_out] == [
        "shard_00000.safetensors",
        "shard_00001.safetensors",
    ]
    manifest = next(j for j in jobs if j.rule == "hidden_manifest")
    assert {Path(i).name for i in manifest.input if "/eval/shard_" in i} >= {
        "shard_00000.safetensors",
        "shard_00001.safetensors",
    }


def test_every_shipped_config_is_valid():
    """Each config a user may copy validates against the schema (several are otherwise read
    only by their rehearsals, which make test-rehearsals runs)."""
    from eaglet.core.config import read_config_file, validate

    shipped = sorted((REPO / "configs").glob("*.yaml")) + sorted(
        (REPO / "tests" / "configs").glob("*.yaml")
    )
    assert len(shipped) >= 8
    for path in shipped:
        validate(read_config_file(path))
