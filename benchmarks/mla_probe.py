"""Probe: does the vLLM CPU engine serve an MLA target (DeepSeek-V3 architecture), and does
hidden-state capture work for it?

Builds a tiny random-weight ``DeepseekV3ForCausalLM`` (MLA attention, MoE layers) with the
embedded target's tokenizer, then starts vLLM twice: plainly, and with eaglet's capture
options (``extract.backend: vllm``). Each attempt's outcome (served, or the error from the
server log) goes to ``benchmarks/results/mla_probe.json``.

    .venv/bin/python benchmarks/mla_probe.py --tokenizer results/target
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import torch

from eaglet.config import validate
from eaglet.extract_vllm import capture_args
from eaglet.io import write_json
from eaglet.server import ServerError, VLLMServer, log_tail, server_args

OUT = Path(__file__).parent / "results"


def tiny_deepseek_v3(directory: Path, tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = DeepseekV3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, num_hidden_layers=4, first_k_dense_replace=1,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
        # DeepSeek-V3's MLA head shapes (the CPU MLA kernel refused a 16+8 head dim)
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        # as the released DeepSeek-V3 config: vLLM then expects the router's correction bias
        topk_method="noaux_tc", scoring_func="sigmoid")
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(config).float().save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def attempt(model: Path, log: Path, extra: list[str]) -> dict:
    cfg = validate({"target": {"dtype": "float32", "max_model_len": 512},
                    "server": {"memory_utilization": 0.25, "enforce_eager": True}})
    args = server_args(cfg["target"], cfg["server"], "target") + extra
    try:
        with VLLMServer(str(model), log, args=args, startup_timeout_s=900) as server:
            body = json.dumps({"model": "target", "prompt": [1, 2, 3, 4], "max_tokens": 4,
                               "temperature": 0}).encode()
            request = urllib.request.Request(server.url + "/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as response:
                answer = json.loads(response.read())
        params = answer.get("kv_transfer_params") or {}
        saved = params.get("hidden_states_path")
        return {"served": True, "hidden_states_file": Path(saved).name if saved else None}
    except (ServerError, urllib.error.HTTPError) as exc:
        lines = [line for line in log_tail(log, 400).splitlines()
                 if "Error" in line or "error" in line]
        return {"served": False, "error": lines[-3:] or str(exc)[:2000]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="a model dir with a tokenizer")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "dsv3"
        tiny_deepseek_v3(model, Path(args.tokenizer))
        plain = attempt(model, OUT / "mla_probe.plain.log", [])
        captured = attempt(model, OUT / "mla_probe.capture.log",
                           capture_args([1, 2, 4], Path(tmp) / "requests"))
        shutil.rmtree(Path(tmp) / "requests", ignore_errors=True)
    result = {"architecture": "DeepseekV3ForCausalLM (tiny, random weights)",
              "plain_serving": plain, "hidden_state_capture": captured}
    write_json(OUT / "mla_probe.json", result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
