"""Probe: does the vLLM CPU engine serve an MLA target (DeepSeek-V3 architecture), does
hidden-state capture work for it, and does it draft with an MLA EAGLE-3 drafter?

Builds a tiny random-weight ``DeepseekV3ForCausalLM`` (MLA attention, MoE layers) with the
given tokenizer, then starts vLLM three times: plainly, with eaglet's capture options
(``extract.backend: vllm``), and with an MLA drafter (``train.drafter_attention: mla``,
exported as ``Eagle3DeepseekV2ForCausalLM``) through ``--speculative-config``. The drafter
starts as training starts it with ``layer_init: target`` and ``lm_head_init: target``; its
greedy drafts are counted by vLLM's spec-decode counters and by eaglet's offline replay of
the same answers (a transformers forward of the target for the features), which agree when
vLLM computes what eaglet trains. Each attempt's outcome (served, or the error from the
server log) goes to ``benchmarks/results/mla_probe.json``; ``--only`` reruns some attempts
and keeps the others' last results there.

    .venv/bin/python benchmarks/mla_probe.py --tokenizer results/target
    .venv/bin/python benchmarks/mla_probe.py --tokenizer results/target --only speculative
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from eaglet.core.config import validate
from eaglet.core.io import read_json, write_json
from eaglet.engine.capture import capture_args
from eaglet.engine.server import ServerError, VLLMServer, log_tail, server_args

OUT = Path(__file__).parent / "results"
AUX_LAYERS = [1, 2, 3]  # of the tiny target's 4 layers (vLLM's DeepSeek model refuses 0)
K = 3
ATTEMPTS = ("plain", "capture", "speculative")
KEYS = {
    "plain": "plain_serving",
    "capture": "hidden_state_capture",
    "speculative": "mla_drafter_spec_decode",
}


def tiny_deepseek_v3(directory: Path, tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = DeepseekV3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        # DeepSeek-V3's MLA head shapes (the CPU MLA kernel refused a 16+8 head dim)
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        # as the released DeepSeek-V3 config: vLLM then expects the router's correction bias
        topk_method="noaux_tc",
        scoring_func="sigmoid",
    )
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(config).float().save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def complete(url: str, prompt: list[int], max_tokens: int) -> dict:
    """One greedy completion of token ids ``prompt``, with the answer's token ids."""
    body = json.dumps(
        {
            "model": "target",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
        }
    ).encode()
    request = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def attempt(model: Path, log: Path, extra: list[str], use=None) -> dict:
    """Serve ``model`` with ``extra`` arguments and send one completion; ``use(server)``, when
    given, does the attempt's work with the running server instead and returns its record."""
    cfg = validate(
        {
            "target": {"dtype": "float32", "max_model_len": 512},
            "server": {"memory_utilization": 0.25, "kv_cache_gib": 0.5, "enforce_eager": True},
        }
    )
    args = server_args(cfg["target"], cfg["server"], "target") + extra
    started = time.monotonic()
    try:
        with VLLMServer(str(model), log, args=args, startup_timeout_s=900) as server:
            ready = round(time.monotonic() - started)
            if use is not None:
                return {"served": True, "ready_after_s": ready, **use(server)}
            answer = complete(server.url, [1, 2, 3, 4], 4)
        params = answer.get("kv_transfer_params") or {}
        saved = params.get("hidden_states_path")
        return {
            "served": True,
            "ready_after_s": ready,
            "hidden_states_file": Path(saved).name if saved else None,
        }
    except (ServerError, urllib.error.HTTPError) as exc:
        lines = [
            line for line in log_tail(log, 400).splitlines() if "Error" in line or "error" in line
        ]
        return {"served": False, "error": lines[-3:] or str(exc)[:2000]}


def mla_drafter(model: Path, directory: Path) -> dict:
    """An MLA drafter of the tiny target, exported as eaglet exports it: the full vocabulary,
    started as training starts it (lm_head and, where they fit, the last layer's attention
    and the final norm from the target, fc passing the deepest aux feature through)."""
    from eaglet.model.config import DrafterConfig
    from eaglet.model.drafter import Eagle3Drafter
    from eaglet.model.export import export_drafter
    from eaglet.model.init import init_from_target, init_lm_head
    from eaglet.target.checkpoint import load_target_embedding, load_target_lm_head

    target = read_json(model / "config.json")
    vocab = target["vocab_size"]
    config = DrafterConfig.from_target(target, vocab, AUX_LAYERS, "mla")
    torch.manual_seed(0)
    drafter = Eagle3Drafter(
        config,
        load_target_embedding(model),
        torch.zeros(vocab, dtype=torch.long),
        torch.ones(vocab, dtype=torch.bool),
    )
    init_lm_head(drafter, load_target_lm_head(model, torch.arange(vocab)))
    fit = init_from_target(drafter, model, target["num_hidden_layers"] - 1)
    export_drafter(drafter, directory)
    return {"layer_init": fit.record()}


def prompts(vocab: int, count: int = 4, length: int = 12) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(10, vocab, (length,), generator=generator).tolist() for _ in range(count)]


def drafting(sent: list[list[int]], max_tokens: int):
    """The attempt's work on a server drafting with the drafter: greedy answers to ``sent``
    and vLLM's spec-decode counters over them."""
    from eaglet.stages.evaluate.metrics import (
        acceptance,
        counter_delta,
        read_metrics,
        spec_counters,
    )

    def use(server) -> dict:
        before = spec_counters(read_metrics(server.url))
        answers = [complete(server.url, prompt, max_tokens)["choices"][0] for prompt in sent]
        served = acceptance(counter_delta(before, spec_counters(read_metrics(server.url))), K)
        return {
            "drafted": served["drafts"] > 0,
            "vllm": served,
            "answers": [answer["token_ids"] for answer in answers],
        }

    return use


def summarized(record: dict) -> dict:
    """The attempt's record as the results file keeps it: the answers' length, not their ids."""
    answers = record.pop("answers", None)
    return {**record, "answer_tokens": sum(map(len, answers))} if answers else record


def replay(
    model: Path, drafter: Path, sent: list[list[int]], answers: list[list[int]], served: dict
) -> dict:
    """eaglet's offline replay of the served answers (the target's features from a float32
    transformers forward), and whether it counts what vLLM counted."""
    from transformers import AutoModelForCausalLM

    from eaglet.model.export import load_drafter
    from eaglet.model.replay import offline_acceptance

    target = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    replayed = offline_acceptance(target, load_drafter(drafter, model), list(zip(sent, answers)), K)
    keys = ("drafts", "draft_tokens", "accepted", "per_position")
    vllm = [
        served["drafts"],
        served["draft_tokens"],
        served["accepted_tokens"],
        [round(p * served["drafts"]) for p in served["per_position_rate"]],
    ]
    return {
        "offline_replay": {k: replayed[k] for k in ("acceptance_length", *keys)},
        "vllm_equals_offline_replay": vllm == [replayed[k] for k in keys],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="a model dir with a tokenizer")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=ATTEMPTS,
        default=list(ATTEMPTS),
        help="attempts to run (the others keep their last results)",
    )
    args = parser.parse_args()
    path = OUT / "mla_probe.json"
    result = read_json(path) if path.exists() and len(args.only) < len(ATTEMPTS) else {}
    result["architecture"] = "DeepseekV3ForCausalLM (tiny, random weights)"
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "dsv3"
        tiny_deepseek_v3(model, Path(args.tokenizer))
        if "plain" in args.only:
            result[KEYS["plain"]] = attempt(model, OUT / "mla_probe.plain.log", [])
        if "capture" in args.only:
            result[KEYS["capture"]] = attempt(
                model,
                OUT / "mla_probe.capture.log",
                capture_args([1, 2, 4], Path(tmp) / "requests"),
            )
            shutil.rmtree(Path(tmp) / "requests", ignore_errors=True)
        if "speculative" in args.only:
            started = time.monotonic()
            drafter = Path(tmp) / "drafter"
            made = mla_drafter(model, drafter)
            spec = json.dumps(
                {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": K}
            )
            sent = prompts(read_json(model / "config.json")["vocab_size"])
            record = attempt(
                model,
                OUT / "mla_probe.speculative.log",
                ["--speculative-config", spec],
                drafting(sent, 24),
            )
            if record.get("drafted"):
                record.update(replay(model, drafter, sent, record["answers"], record["vllm"]))
            record["drafter"] = {
                "architectures": read_json(drafter / "config.json")["architectures"],
                **made,
            }
            record["wall_s"] = round(time.monotonic() - started)
            result[KEYS["speculative"]] = summarized(record)
    write_json(path, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
