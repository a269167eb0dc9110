"""`eaglet rehearse`: the miniature keeps the target's architecture and shrinks only sizes,
the rehearsal config keeps the run's settings and scales only what cannot run here, and (end
to end) a shipped run config rehearses green on its target's stand-in files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from eaglet.tools import rehearsal_checks, rehearse
from eaglet.tools.miniature import LAYERS, shrink
from tests.helpers.paths import REPO, STANDINS


def test_the_miniature_keeps_the_attention_and_moe_kind_and_shrinks_sizes():
    text = json.loads((STANDINS / "kimi-k2.5" / "config.json").read_text())["text_config"]
    small, changes = shrink(text)
    # MLA: the head shapes the engine's kernels accept stay the target's
    for key in (
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "model_type",
        "topk_method",
        "scoring_func",
        "n_shared_experts",
        "rope_scaling",
        "vocab_size",
    ):
        assert small.get(key) == text.get(key), key
    assert small["hidden_size"] < text["hidden_size"]
    assert small["num_hidden_layers"] == LAYERS < text["num_hidden_layers"]
    assert small["n_routed_experts"] < text["n_routed_experts"]
    assert small["num_experts_per_tok"] <= small["n_routed_experts"]
    assert small["q_lora_rank"] is not None  # query compression stays on
    assert "quantization_config" not in small and "quantization_config dropped" in changes
    assert small["first_k_dense_replace"] == 1  # dense layers first, then MoE, as the target


def test_the_miniature_keeps_grouped_query_attention_and_the_head_size():
    text = json.loads((STANDINS / "qwen3-8b" / "config.json").read_text())
    small, _ = shrink(text)
    assert small["head_dim"] == text["head_dim"]
    assert small["num_key_value_heads"] < small["num_attention_heads"]
    assert small["vocab_size"] == text["vocab_size"]
    layers = {
        k: v for k, v in text.items() if isinstance(v, list) and len(v) == text["num_hidden_layers"]
    }
    for key in layers:  # per-layer lists follow the depth
        assert len(small[key]) == small["num_hidden_layers"], key


def test_the_rehearsal_config_keeps_the_runs_settings_and_lists_what_it_scales(tmp_path):
    user = yaml.safe_load((REPO / "configs" / "kimi-k2.5.yaml").read_text())
    text = json.loads((STANDINS / "kimi-k2.5" / "config.json").read_text())["text_config"]
    cfg, scaled = rehearse.rehearsal_config(user, tmp_path / "mini", tmp_path / "results", text)
    for dotted in (
        "target.trust_remote_code",
        "server.reasoning_parser",
        "generate.chat_template_kwargs",
        "generate.temperature",
        "generate.capture_hidden_states",
        "extract.backend",
        "extract.dtype",
        "train.ttt_steps",
        "evaluate.offline",
    ):
        assert rehearsal_checks._get(cfg, dotted) == rehearsal_checks._get(user, dotted), dotted
    assert cfg["evaluate"]["num_speculative_tokens"] == [3]  # one server per k: the smallest
    assert cfg["target"]["model"] == str(tmp_path / "mini")
    assert cfg["server"]["tensor_parallel_size"] == 1 and cfg["server"]["gpus"] == 0
    assert any(line.startswith("server.tensor_parallel_size: 8 -> 1") for line in scaled)
    assert not any(line.startswith("server.url") for line in scaled)  # unset, and stays so
    # an MLA target on the CPU engine: only an MLA drafter serves beside it
    assert cfg["train"]["drafter_attention"] == "mla"
    qwen = json.loads((STANDINS / "qwen3-8b" / "config.json").read_text())
    cfg, _ = rehearse.rehearsal_config(user, tmp_path / "mini", tmp_path / "results", qwen)
    assert "drafter_attention" not in cfg["train"]
    assert any(line.startswith("vocab.draft_vocab_size: 32000 -> ") for line in scaled)
    from eaglet.core.config import validate

    validate(cfg)  # the rehearsal's own config is valid


def test_the_real_targets_files_are_checked_against_the_runs_settings(tmp_path):
    """Aux layer ids past the target's depth fail the rehearsal's first check, naming the
    setting, before any miniature is built."""
    user = yaml.safe_load((REPO / "configs" / "kimi-k2.5.yaml").read_text())
    user["extract"]["aux_layer_ids"] = [2, 30, 61]
    report = rehearsal_checks.Report()
    rehearsal_checks.check_target(STANDINS / "kimi-k2.5", user, report)
    failed = [c for c in report.checks if c.ok is False]
    assert failed and "extract.aux_layer_ids" in failed[0].detail
    assert not report.passed


def test_the_drafters_attention_is_checked_against_the_targets(tmp_path):
    """train.drafter_attention: mla on a target without multi-head latent attention fails
    the rehearsal's first checks, naming the setting and its fix; llama and mla both hold on
    an MLA target, and P-EAGLE needs llama."""
    user = yaml.safe_load((REPO / "configs" / "qwen3-8b.yaml").read_text())
    user["train"]["drafter_attention"] = "mla"
    report = rehearsal_checks.Report()
    rehearsal_checks.check_target(STANDINS / "qwen3-8b", user, report)
    [drafter] = [c for c in report.checks if c.stage == "drafter"]
    assert drafter.ok is False and not report.passed
    assert "train.drafter_attention mla" in drafter.detail and "kv_lora_rank" in drafter.detail
    assert "train.drafter_attention: llama" in drafter.fix
    # the memory plan still reads the target, for the drafter that can be built
    assert [c.ok for c in report.checks if c.stage == "plan"] == [True]
    user["train"]["drafter_attention"] = "llama"
    report = rehearsal_checks.Report()
    rehearsal_checks.check_target(STANDINS / "qwen3-8b", user, report)
    assert report.passed, report.checks
    kimi = yaml.safe_load((REPO / "configs" / "kimi-k2.5.yaml").read_text())
    for attention in ("llama", "mla"):
        kimi["train"]["drafter_attention"] = attention
        report = rehearsal_checks.Report()
        rehearsal_checks.check_target(STANDINS / "kimi-k2.5", kimi, report)
        assert report.passed, report.checks
        assert any(
            c.stage == "drafter" and f"drafter_attention {attention}" in c.detail
            for c in report.checks
        )
    kimi["train"]["method"] = "peagle"
    report = rehearsal_checks.Report()
    rehearsal_checks.check_target(STANDINS / "kimi-k2.5", kimi, report)
    [drafter] = [c for c in report.checks if c.stage == "drafter"]
    assert drafter.ok is False and "train.drafter_attention: llama" in drafter.fix


def test_a_dflash_run_is_checked_on_the_target_and_rehearsed_where_the_engine_can_serve_it(
    tmp_path,
):
    """train.method dflash: buildable for any target with Llama attention and the plain
    norms (the real target's check says so, naming DFlashDraftModel), refused with MLA
    attention or the EAGLE-3.1 norms; rehearsed as DFlash where the CPU engine serves it beside
    the miniature, and beside an MLA target (whose attention the CPU engine cannot pair with
    DFlash's) with an MLA EAGLE-3 drafter, the scaled list saying why."""
    from eaglet.core.config import validate

    for name in ("qwen3-8b", "kimi-k2.5"):
        user = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
        user["train"]["method"] = "dflash"
        user["train"]["dflash_layers"] = 2
        user["train"].pop("drafter_attention", None)
        report = rehearsal_checks.Report()
        rehearsal_checks.check_target(STANDINS / name, user, report)
        [drafter] = [c for c in report.checks if c.stage == "drafter"]
        assert drafter.ok and "2 Qwen3 layers" in drafter.detail, drafter.detail
        assert "DFlashDraftModel" in drafter.detail and report.passed
        assert any(c.stage == "plan" and c.ok for c in report.checks)
        assert "method dflash of 2 layers" in report.plan
        text = json.loads((STANDINS / name / "config.json").read_text())
        cfg, scaled = rehearse.rehearsal_config(
            user, tmp_path / "mini", tmp_path / "r", text.get("text_config", text)
        )
        validate(cfg)
        if name == "qwen3-8b":
            assert cfg["train"]["method"] == "dflash" and "drafter_attention" not in cfg["train"]
        else:
            assert cfg["train"]["method"] == "eagle3"
            assert cfg["train"]["drafter_attention"] == "mla"
            assert any(line.startswith("train.method: 'dflash' -> 'eagle3'") for line in scaled)
    for bad in ({"drafter_attention": "mla"}, {"drafter_variant": "eagle3.1"}):
        user = yaml.safe_load((REPO / "configs" / "kimi-k2.5.yaml").read_text())
        user["train"].update({"method": "dflash", **bad})
        report = rehearsal_checks.Report()
        rehearsal_checks.check_target(STANDINS / "kimi-k2.5", user, report)
        [drafter] = [c for c in report.checks if c.stage == "drafter"]
        assert drafter.ok is False and "drafter_attention: llama" in drafter.fix


def test_a_failed_stage_is_reported_by_its_own_exception_not_the_servers_shutdown(tmp_path):
    log = tmp_path / "snakemake.log"
    log.write_text(
        "Error in rule generate:\n    jobid: 5\n"
        "Logfile results/logs/generate.log:\n"
        "Traceback (most recent call last):\n"
        "    raise TemplateMismatchError(\n"
        "eaglet.data.template_check.TemplateMismatchError: 63 of 64 samples do not re-render\n"
        "(APIServer pid=1) ERROR [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
        "EngineCore encountered an issue.\n"
        "WorkflowError:\nAt least one job did not complete successfully.\n"
    )
    assert rehearse.failed_rule(log) == (
        "generate: eaglet.data.template_check.TemplateMismatchError: 63 of 64 samples do not re-render"
    )


def test_a_sampled_run_is_held_to_its_drafts_exactly_and_to_its_expectation_within_noise():
    """At the served temperature the rehearsal checks what holds on any number of prompts:
    vLLM's answers took the replay's drafts as vLLM counted; and vLLM's AL is the expected
    one within the tolerance or within the sampling noise of the miniature's few prompts."""
    row = {
        "temperature": 1.0,
        "vllm_acceptance_length": 2.55,
        "acceptance_length": 2.45,
        "matched_acceptance_length": 2.55,
        "ratio_offline_over_vllm": 2.45 / 2.55,
        "standard_error": 0.1,
        "drafts": 40,
        "tolerance": 0.03,
        "agrees": False,
        "within_noise": True,
    }
    ok, text, fix = rehearsal_checks.expected_line("eagle3_k3_T1", row)
    assert ok and fix == "" and "standard error 0.100 over 40 drafting steps" in text
    ok, _, fix = rehearsal_checks.expected_line("eagle3_k3_T1", {**row, "within_noise": False})
    assert not ok and "another distribution" in fix
    ok, _, fix = rehearsal_checks.expected_line(
        "eagle3_k3_T1", {**row, "agrees": True, "matched_acceptance_length": 2.3}
    )
    assert not ok and "the drafts differ" in fix
    assert not rehearsal_checks.expected_line("eagle3_k3_T1", {**row, "acceptance_length": None})[0]


# Every shipped config rehearses with `make test-rehearsals` (EAGLET_REHEARSE_ALL=1), each
# 5.5 to 10.5 minutes on 2 cores: six reasoning formats in all (tests/standins/README.md),
# each rehearsed green with nothing of it named in eaglet. `make test` rehearses none: the
# founding user's (MLA, MoE, the multimodal wrapper, a tokenizer as code, an MTP layer) took
# 10.5 of its 59.7 minutes on a slow day, which put CI within 8 minutes of its limit; the
# rehearsal's parts stay in `make test` (the checks, the miniature, the error paths above).
OTHER_CONFIGS = pytest.mark.skipif(
    not os.environ.get("EAGLET_REHEARSE_ALL"),
    reason="rehearsed by `make test-rehearsals` (EAGLET_REHEARSE_ALL=1)",
)


# the stand-ins whose tokenizer file is built from a vLLM dependency's own data (too large
# to keep in the repository: tests/standins/README.md), by the script that builds it
BUILT_TOKENIZERS = {
    "gpt-oss-20b": ("tokenizer.json", "make_harmony_tokenizer.py"),
    "magistral-small-2507": ("tekken.json", "make_tekken_tokenizer.py"),
}


def standin_files(name: str, tmp_path: Path) -> Path:
    """A stand-in's folder; gpt-oss's with its tokenizer built from the installed harmony
    encoding, Magistral's from mistral_common's Tekken vocabulary."""
    built, script = BUILT_TOKENIZERS.get(name, (None, None))
    if built is None or (STANDINS / name / built).exists():
        return STANDINS / name
    import shutil
    import subprocess
    import sys

    files = tmp_path / "files" / name
    shutil.copytree(STANDINS / name, files)
    subprocess.run(
        [sys.executable, str(STANDINS / script), str(files)], check=True, capture_output=True
    )
    return files


@pytest.mark.e2e
@pytest.mark.parametrize(
    "name",
    [
        *(
            pytest.param(n, marks=OTHER_CONFIGS)
            for n in (
                "kimi-k2.5",
                "qwen3-8b",
                "deepseek-r1-distill-qwen-7b",
                "gemma-4-e2b-it",
                "gpt-oss-20b",
                "magistral-small-2507",
            )
        ),
    ],
)
def test_a_shipped_config_rehearses_green_on_its_stand_in(name, tmp_path):
    files = standin_files(name, tmp_path)
    mtp = name == "kimi-k2.5"
    if mtp:
        # Kimi-K2.5 declares no MTP layer; DeepSeek-V3, its architecture's first release,
        # and GLM-4.5 declare one: declared here, its rehearsal also shows the target's own
        # MTP baseline served by vLLM from the miniature's MTP layer
        files = declare_mtp_layer(files, tmp_path)
    out = tmp_path / name
    code = rehearse.main(
        [
            "--configfile",
            str(REPO / "configs" / f"{name}.yaml"),
            "--target-files",
            str(files),
            "--out",
            str(out),
            "--cores",
            "2",
        ]
    )
    result = json.loads((out / "rehearsal.json").read_text())
    assert code == 0 and result["passed"], json.dumps(result["checks"], indent=1)
    stages = {c["stage"] for c in result["checks"] if c["ok"]}
    assert {
        "target",
        "miniature",
        "generate",
        "reasoning",
        "extract",
        "train",
        "evaluate",
    } <= stages, stages
    if mtp:
        acceptance = json.loads((out / "results" / "eval" / "acceptance.json").read_text())
        served = [r for r in acceptance["runs"] if r["method"] == "mtp"]
        assert served and all(r["drafts"] for r in served), acceptance["not_measured"]
        assert not acceptance["not_measured"]


def declare_mtp_layer(files: Path, tmp_path: Path) -> Path:
    """A copy of a stand-in's files whose language model declares one MTP layer."""
    import shutil

    copy = tmp_path / "files-mtp" / files.name
    shutil.copytree(files, copy)
    config = json.loads((copy / "config.json").read_text())
    text = config.get("text_config", config)
    text["num_nextn_predict_layers"] = 1
    (copy / "config.json").write_text(json.dumps(config, indent=1))
    return copy


def test_a_streamed_run_reports_its_streamed_states_not_missing_shards(tmp_path):
    """train.data stream writes the held-out shard alone: the rehearsal says so, and reads
    how training got its states (requests, teacher agreement) from drafter/stats.json."""
    results = tmp_path / "results"
    for path, data in {
        "synthetic/stats.json": {"template_check": {"checked": 3}},
        "hidden/manifest.json": {"shards": [], "eval_shards": [{"file": "e"}]},
        "drafter/stats.json": {
            "stream": {"requests": 95, "saved_files": 0, "teacher_agreement": 0.937}
        },
    }.items():
        (results / path).parent.mkdir(parents=True, exist_ok=True)
        (results / path).write_text(json.dumps(data))
    for split in ("train", "eval"):
        (results / "synthetic" / f"{split}.jsonl").write_text("")
    (results / "drafter" / "model.safetensors").write_bytes(b"")
    report = rehearsal_checks.Report()
    cfg = {"server": {}, "train": {"data": "stream"}}
    rehearsal_checks.check_results(results, cfg, report)
    said = {c.stage: c.detail for c in report.checks}
    assert said["extract"] == "1 held-out shard(s) only (train.data stream)"
    assert said["train"] == (
        "drafter trained and exported on streamed states: 95 prefill "
        "requests to its own capture server, 0 files saved by generation, "
        "teacher agreement 0.937"
    )


@pytest.mark.subprocess  # heavy in-process: 3 minutes on 2 cores
def test_a_miniature_taught_too_briefly_says_it_did_not_learn_the_format(tmp_path):
    """The teaching must reach the format or say it could not: a second of teaching leaves
    the miniature's answers without their closer or their end of turn, and the build reports
    how many of its greedy and sampled answers were in the format, and the first that was
    not."""
    from eaglet.tools.miniature import build

    info = build(
        STANDINS / "qwen3-8b",
        tmp_path / "mini",
        trust_remote_code=False,
        template_kwargs={"enable_thinking": True},
        reasoning_parser="qwen3",
        teach_seconds=1.0,
    )
    learned = info["taught"]["learned"]
    assert learned["answers"] == 12 and learned["in_format"] < learned["answers"]
    failure = learned["first_failure"]
    assert failure and not (failure["ended_turn"] and failure["closed_reasoning"])
    assert "template's rendering of the answer" in info["taught"]["format"]


@pytest.mark.subprocess  # rehearse asks vLLM in a subprocess
def test_an_error_inside_the_rehearsal_ends_in_its_fail_line_and_the_summary(
    tmp_path, monkeypatch, capsys
):
    """A miniature that cannot be built (or any error past the config's check) is a FAIL
    line of the report, with the summary and rehearsal.json, never a traceback."""
    from eaglet.tools.miniature import MiniatureError

    def cannot(*args, **kwargs):
        raise MiniatureError("the parser names no markers")

    monkeypatch.setattr(rehearse, "build", cannot)
    out = tmp_path / "out"
    code = rehearse.main(
        [
            "--configfile",
            str(REPO / "configs" / "qwen3-8b.yaml"),
            "--target-files",
            str(STANDINS / "qwen3-8b"),
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 1
    assert "FAIL miniature  MiniatureError: the parser names no markers" in printed, printed
    assert "REHEARSAL FAILED" in printed
    result = json.loads((out / "rehearsal.json").read_text())
    assert not result["passed"] and result["checks"][-1]["stage"] == "miniature"


def test_the_miniature_carries_the_mtp_layers_its_target_declares_where_vllm_reads_them(
    tmp_path,
):
    """A DeepSeek-V3-class miniature declaring an MTP layer gets its weights beside its own, at
    decoder layer num_hidden_layers under the names the target's own layers are saved with
    (per-expert, as checkpoints name them) and the MTP layer's own parts, so the rehearsal's
    evaluation serves its mtp baseline as vLLM serves the real target's."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from eaglet.engine.support import mtp_served
    from eaglet.target.checkpoint import weight_map
    from eaglet.tools.miniature import MTP_FILE, MTP_NORMS, add_mtp_layers

    config = DeepseekV3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        num_nextn_predict_layers=1,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    assert mtp_served(tmp_path)[0] == 0  # declared, not held: vLLM would refuse it
    written = add_mtp_layers(model, config.to_dict(), tmp_path)
    assert written == {"layers": 1, "file": MTP_FILE, "tensors": written["tensors"]}
    assert mtp_served(tmp_path) == (1, None)
    names = weight_map(tmp_path)
    mtp = {n.removeprefix("model.layers.2.") for n in names if n.startswith("model.layers.2.")}
    last = {n.removeprefix("model.layers.1.") for n in names if n.startswith("model.layers.1.")}
    # the decoder layer of the target's kind (MoE past first_k_dense_replace), per expert
    assert last < mtp and "mlp.experts.3.down_proj.weight" in mtp
    own = {f"{norm}.weight" for norm in MTP_NORMS} | {
        "eh_proj.weight",
        "shared_head.head.weight",
    }
    assert mtp - last == own
    # MTP layers in a container of the model's own (Qwen3.5's mtp.): none built, and said
    qwen = {"num_hidden_layers": 2, "mtp_num_hidden_layers": 1}
    assert "mtp_num_hidden_layers" in add_mtp_layers(model, qwen, tmp_path / "q")["why"]
    assert add_mtp_layers(model, {"num_hidden_layers": 2}, tmp_path / "none") is None
    # the miniature's own weights are untouched: transformers still loads it as it was
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)
