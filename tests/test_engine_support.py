"""What the installed vLLM does with a target, asked of vLLM itself: the CPU engine's attention
backend for MLA models (the same on a CPU with AMX and without), the CPU's instruction set,
and a target whose class cannot serve a drafter refused before any stage or server starts."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from eaglet.core.config import validate
from eaglet.engine import support
from eaglet.engine.server import ServerError, target_server
from eaglet.tools import plan, rehearse
from tests.helpers.paths import REPO, SNAKEMAKE, STANDINS, TEST_CONFIGS

KIMI = json.loads((STANDINS / "kimi-k2.5" / "config.json").read_text())
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64}
MLA_DRAFTER = {
    "architectures": ["Eagle3DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
}
LLAMA_DRAFTER = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama"}
# flags of three x86 CPUs: AMX (Sapphire Rapids and later), AVX-512 without AMX, AVX2 only
CPUS = {
    "amx": {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"},
    "avx512": {"avx2", "avx512f"},
    "avx2": {"avx2", "fma"},
}


def model_dir(tmp_path: Path, name: str, config: dict) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def cpu_server(tmp_path, model: str, dtype: str = "float32", extra=()):
    cfg = validate({"server": {"gpus": 0}, "target": {"dtype": dtype}})
    return target_server(cfg, model, tmp_path / "server.log", list(extra))


def speculative(args: list[str]) -> dict:
    return json.loads(args[args.index("--speculative-config") + 1])


@pytest.mark.parametrize("cpu", sorted(CPUS))
def test_an_mla_target_on_the_cpu_engine_gets_the_backend_that_takes_float32_on_any_cpu(
    tmp_path, monkeypatch, cpu
):
    """vLLM's CPU platform serves MLA with its AMX backend where the CPU has AMX tiles, and
    that backend refuses float32 weights: every server of an MLA model in float32 asks for
    CPU_MLA, whatever CPU it lands on (the flags are the test's, not this machine's)."""
    monkeypatch.setattr(support, "cpu_flags", lambda *a: CPUS[cpu])
    kimi = model_dir(tmp_path, "kimi", KIMI)
    args = cpu_server(tmp_path, kimi).args
    assert args[args.index("--attention-backend") + 1] == "CPU_MLA"
    # bfloat16 weights: the AMX backend takes them, vLLM's own choice stands
    assert "--attention-backend" not in cpu_server(tmp_path, kimi, "bfloat16").args
    # a model without MLA (the demo's Llama) is served as before
    assert (
        "--attention-backend" not in cpu_server(tmp_path, model_dir(tmp_path, "llama", LLAMA)).args
    )
    # GPUs choose their own backends
    gpu = validate({"server": {"gpus": 1}, "target": {"dtype": "float32"}})
    assert "--attention-backend" not in target_server(gpu, kimi, tmp_path / "g.log").args


def test_every_model_a_cpu_server_runs_gets_its_backend_the_drafter_through_its_own_setting(
    tmp_path, monkeypatch
):
    """vLLM never gives a draft model the target's backend (it chooses again, and would pick
    AMX MLA): an MLA drafter's backend goes in the speculative config; the capture and MTP
    run the target's own layers; n-gram runs none."""
    monkeypatch.setattr(support, "cpu_flags", lambda *a: CPUS["amx"])
    kimi = model_dir(tmp_path, "kimi", KIMI)
    llama = model_dir(tmp_path, "llama", LLAMA)

    def spec_of(model: str, spec: dict) -> dict:
        return speculative(
            cpu_server(tmp_path, model, extra=["--speculative-config", json.dumps(spec)]).args
        )

    mla = model_dir(tmp_path, "mla-drafter", MLA_DRAFTER)
    assert spec_of(kimi, {"method": "eagle3", "model": mla})["attention_backend"] == "CPU_MLA"
    assert spec_of(kimi, {"method": "extract_hidden_states"})["attention_backend"] == "CPU_MLA"
    assert spec_of(kimi, {"method": "mtp"})["attention_backend"] == "CPU_MLA"
    assert "attention_backend" not in spec_of(kimi, {"method": "ngram"})
    plain = model_dir(tmp_path, "llama-drafter", LLAMA_DRAFTER)
    assert "attention_backend" not in spec_of(llama, {"method": "eagle3", "model": plain})
    assert "attention_backend" not in spec_of(llama, {"method": "extract_hidden_states"})
    # a backend the user named is theirs
    named = cpu_server(tmp_path, kimi, extra=["--attention-backend", "AMX_MLA"]).args
    assert named.count("--attention-backend") == 1 and "AMX_MLA" in named


def test_mla_is_what_vllm_says_it_is():
    """vLLM's own rule decides (its model-arch config's is_deepseek_mla): a latent rank in a
    config of a model vLLM does not serve with MLA does not make it MLA."""
    assert support.uses_mla(KIMI) is True
    assert support.uses_mla({**LLAMA, "kv_lora_rank": 512}) is False
    assert support.uses_mla(LLAMA) is False


def test_a_cpu_without_the_instructions_the_engine_needs_is_named_before_a_server_starts(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(support, "cpu_flags", lambda *a: {"sse4_2", "avx"})
    with pytest.raises(ServerError, match="lacks AVX2"):
        cpu_server(tmp_path, str(tmp_path / "no-model"))
    assert not (tmp_path / "server.log").exists()
    assert support.cpu_engine_problem(CPUS["avx2"]) is None
    assert support.cpu_engine_problem(set()) is None  # no flags to read (not x86 Linux)


# -- a target vLLM cannot serve a drafter for -------------------------------------------------

GLM = STANDINS / "glm-4.5-air"


@pytest.mark.subprocess
def test_vllm_is_asked_which_targets_classes_serve_a_drafter():
    glm = support.ask_in_subprocess(GLM / "config.json")
    assert glm["supports_eagle3"] is False and glm["mtp_layers"] == 1, glm
    assert glm["model_class"] == "vllm.model_executor.models.glm4_moe.Glm4MoeForCausalLM"
    message = support.refusal(glm, "EAGLE-3", "zai-org/GLM-4.5-Air")
    for part in (
        "vLLM 0.32",
        "Glm4MoeForCausalLM",
        "SupportsEagle3",
        '"method": "mtp"',
        '"method": "ngram"',
        "zai-org/GLM-4.5-Air",
    ):
        assert part in message, (part, message)
    qwen = support.ask_in_subprocess(STANDINS / "qwen3-8b" / "config.json")
    assert qwen["supports_eagle3"] is True and support.refusal(qwen, "DFlash", "qwen") is None
    # without MTP layers, n-gram is the option
    assert "mtp" not in support.refusal({**glm, "mtp_layers": 0}, "EAGLE-3", "t")


def local_config(tmp_path: Path) -> Path:
    user = yaml.safe_load((TEST_CONFIGS / "glm-4.5-air.yaml").read_text())
    target = tmp_path / "glm"
    shutil.copytree(GLM, target)
    user["target"]["model"] = str(target)
    user["results_dir"] = str(tmp_path / "results")
    path = tmp_path / "glm.yaml"
    path.write_text(yaml.safe_dump(user))
    return path


@pytest.mark.subprocess
def test_plan_refuses_a_target_vllm_cannot_serve_a_drafter_for(tmp_path, capsys):
    assert plan.main(["--configfile", str(local_config(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "cannot serve EAGLE-3 drafters" in err and "Glm4MoeForCausalLM" in err, err


@pytest.mark.subprocess
def test_rehearse_refuses_it_before_building_a_miniature(tmp_path, capsys):
    out = tmp_path / "out"
    code = rehearse.main(
        [
            "--configfile",
            str(TEST_CONFIGS / "glm-4.5-air.yaml"),
            "--target-files",
            str(GLM),
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    result = json.loads((out / "rehearsal.json").read_text())
    assert code == 1 and not result["passed"]
    failed = [c for c in result["checks"] if c["ok"] is False]
    assert [c["stage"] for c in failed] == ["serving"], failed
    assert "SupportsEagle3" in failed[0]["detail"] and '"method": "mtp"' in failed[0]["detail"]
    assert "FAIL serving" in printed and "Traceback" not in printed
    assert not (out / "miniature").exists() and not (out / "results").exists()


@pytest.mark.subprocess
def test_the_workflows_first_stage_refuses_it_before_any_server(tmp_path):
    config = local_config(tmp_path)
    done = subprocess.run(
        [
            str(SNAKEMAKE),
            str(tmp_path / "results" / "target" / "target.json"),
            "--cores",
            "1",
            "--configfile",
            str(config),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    log = (tmp_path / "results" / "logs" / "prepare_target.log").read_text()
    assert "cannot serve EAGLE-3 drafters" in log and "Glm4MoeForCausalLM" in log, log
    assert not (tmp_path / "results" / "target" / "target.json").exists()
    assert not list((tmp_path / "results" / "logs").glob("*server*"))


# -- the target's own MTP layers: served only where the checkpoint holds them -----------------

DEEPSEEK_MTP = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 8}


def checkpoint(tmp_path: Path, config: dict, names: list[str] | None) -> Path:
    """A target directory with ``config`` and a safetensors index naming ``names`` (none:
    config files alone)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    if names is not None:
        index = {"weight_map": {name: "model-00001.safetensors" for name in names}}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp_path


@pytest.mark.parametrize(
    "config, names, held",
    [
        # DeepSeek-V3 and GLM-4.5: MTP layer i is decoder layer num_hidden_layers + i
        ({**DEEPSEEK_MTP, "num_nextn_predict_layers": 1}, ["model.layers.8.eh_proj.weight"], 1),
        ({**DEEPSEEK_MTP, "num_nextn_predict_layers": 1}, ["model.layers.7.mlp.weight"], 0),
        # a wrapper's language model: its layers under the wrapper's container
        (
            {"text_config": {**DEEPSEEK_MTP, "num_nextn_predict_layers": 2}},
            ["language_model.model.layers.8.enorm.weight"],
            1,
        ),
        # Qwen3.5 and MiMo: an mtp container of their own
        ({"num_hidden_layers": 8, "mtp_num_hidden_layers": 1}, ["mtp.fc.weight"], 1),
        (
            {"num_hidden_layers": 8, "num_nextn_predict_layers": 1},
            ["model.mtp_layers.0.norm.weight"],
            1,
        ),
    ],
)
def test_the_mtp_layers_a_checkpoint_holds_are_read_where_vllm_reads_them(config, names, held):
    assert support.mtp_layers_held(config, ["model.embed_tokens.weight", *names]) == held


def test_an_mtp_baseline_is_served_only_where_the_checkpoint_holds_its_weights(tmp_path):
    config = {**DEEPSEEK_MTP, "num_nextn_predict_layers": 1}
    held = checkpoint(tmp_path / "held", config, ["model.layers.8.eh_proj.weight"])
    assert support.mtp_served(held) == (1, None)
    assert support.mtp_note(held)[0] is True
    assert "measures vLLM's mtp at k 1" in support.mtp_note(held)[1]
    # a quantized release that dropped them: none served, and the reason says so
    dropped = checkpoint(tmp_path / "dropped", config, ["model.layers.7.mlp.weight"])
    served, why = support.mtp_served(dropped)
    assert served == 0 and "the checkpoint holds no MTP weights" in why
    assert support.mtp_note(dropped) == (
        None,
        f"{why}; the evaluation reports its mtp baseline as not measured",
    )
    # config files alone: the declaration stands until the weights say otherwise
    files = checkpoint(tmp_path / "files", config, None)
    assert support.mtp_served(files) == (1, None)
    assert support.mtp_note(files)[0] is None
    # nothing declared: nothing to say
    assert support.mtp_note(checkpoint(tmp_path / "none", DEEPSEEK_MTP, None)) is None


# -- Mistral's own format: vLLM's Mistral mode takes no chat_template_kwargs -------------------


def mistral_files(tmp_path: Path, *names: str) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MistralForCausalLM"]}))
    for name in names:
        (tmp_path / name).write_text("{}")
    return tmp_path


def test_vllms_mistral_mode_is_decided_by_its_own_rule(tmp_path):
    # consolidated weights beside a Mistral tokenizer: Mistral mode
    assert support.mistral_mode(
        mistral_files(tmp_path / "a", "params.json", "tekken.json", "consolidated.safetensors")
    )
    assert support.mistral_mode(
        mistral_files(tmp_path / "b", "tokenizer.model.v3", "consolidated-00001.safetensors")
    )
    # HF weights, or no Mistral tokenizer: HF mode
    assert (
        support.mistral_mode(mistral_files(tmp_path / "c", "tekken.json", "model.safetensors"))
        is False
    )
    assert support.mistral_mode(mistral_files(tmp_path / "d", "consolidated.safetensors")) is False
    # Mistral's format with no weights to decide by (config files alone)
    assert support.mistral_mode(mistral_files(tmp_path / "e", "params.json", "tekken.json")) is None


def test_chat_template_kwargs_on_a_mistral_mode_target_are_refused_with_the_fix(tmp_path):
    files = mistral_files(tmp_path / "m", "params.json", "tekken.json")
    kwargs = {"enable_thinking": True}
    refused = support.template_kwargs_refusal(files, kwargs)
    assert "refuses every request that carries chat_template_kwargs" in refused
    assert "Remove generate.chat_template_kwargs" in refused
    assert support.template_kwargs_refusal(files, None) is None
    hf = mistral_files(tmp_path / "hf", "tokenizer.json", "model.safetensors")
    assert support.template_kwargs_refusal(hf, kwargs) is None


def mistral_config(tmp_path: Path) -> Path:
    files = mistral_files(tmp_path / "target", "params.json", "tekken.json")
    user = {
        "target": {"model": str(files)},
        "generate": {"chat_template_kwargs": {"enable_thinking": True}},
        "results_dir": str(tmp_path / "results"),
    }
    path = tmp_path / "mistral.yaml"
    path.write_text(yaml.safe_dump(user))
    return path


def test_plan_refuses_chat_template_kwargs_for_a_mistral_mode_target(tmp_path, capsys):
    assert plan.main(["--configfile", str(mistral_config(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "chat_template_kwargs" in err and "Mistral mode" in err, err


def test_rehearse_refuses_chat_template_kwargs_for_a_mistral_mode_target(tmp_path, capsys):
    config = mistral_config(tmp_path)
    out = tmp_path / "out"
    code = rehearse.main(
        ["--configfile", str(config), "--target-files", str(tmp_path / "target"), "--out", str(out)]
    )
    result = json.loads((out / "rehearsal.json").read_text())
    failed = [c for c in result["checks"] if c["ok"] is False]
    assert code == 1 and [c["stage"] for c in failed] == ["serving"], failed
    assert "mistral_common" in failed[0]["detail"]
    assert not (out / "miniature").exists() and not (out / "results").exists()
