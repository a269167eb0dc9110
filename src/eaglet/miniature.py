"""A miniature of a target: the same architecture at toy widths, random weights, taught the
target's chat format, for `eaglet rehearse`.

Built from the target's config and tokenizer files alone (no weights): the config keeps its
class, model_type, attention and MoE kind, special tokens, chat template and vocabulary;
only widths, depths and expert counts shrink. Head shapes stay the target's: the engine's
kernels accept the shapes real models have (the CPU MLA kernel refused a 16+8 head), and a
miniature that the engine refuses for a shape of its own would rehearse nothing.

A random model emits random tokens: no reasoning wrapper, no end of turn, nothing for a
reasoning parser to split. So the miniature is taught the target's format for a few
minutes: conversations rendered through the target's own chat template with the run's
template variables, each answer a short reasoning (where the template renders one) and a
recorded answer, so that greedy generation emits the wrapper tokens and ends its turn.

A multimodal wrapper (a config with ``text_config``) is built as its language model: on the
CPU engine the wrapper's processors cannot load (they import torchvision, which no wheel
for this torch provides), and the drafter reads the language model alone either way. The
rehearsal reports this as a part it cannot show.
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import time
from pathlib import Path

log = logging.getLogger("eaglet.miniature")

# The toy widths. Keys absent from a config are skipped; a key the config sets to null
# stays null (q_lora_rank null means no query compression, an architecture choice).
WIDTHS = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_attention_heads": 4,
    "q_lora_rank": 64,
}
LAYERS = 8  # vLLM's default aux layers (2, L//2, L-3) are distinct from 7 layers on
EXPERT_COUNTS = {"n_routed_experts": 8, "num_experts": 8, "num_local_experts": 8,
                 "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1}
# dropped: the miniature is float32 and unquantized on the CPU engine
DROPPED = ("quantization_config", "auto_map")

# Tokens of one taught answer, and the teaching budget.
ANSWERS = ["Yes, this is a short answer.", "No, that is not right.",
           "Here is what I would do first.", "It depends on the case.",
           "That is a good question.", "I think the answer is yes."]
REASONING = ["The user asks a question. I will answer briefly.",
             "The user wants to know something. A short answer is best."]
TEACH_SAMPLES = 160
# The "other" row is taught as if it stood for e**OTHER_MARGIN times more tokens than it does,
# and the taught head is sharpened by SHARPEN (its logits scaled) afterwards: a run that samples
# at temperature 1 (a thinking model's serving setting) then keeps to the taught tokens and
# their order, where a toy model's residual uncertainty would otherwise emit tokens outside
# them (a stand-in tokenizer's holes among them) or end the reasoning early.
OTHER_MARGIN, SHARPEN = 4.0, 3.0
# Teaching takes TEACH_STEPS steps of TEACH_BATCH sequences (the same miniature on any machine),
# within the rehearsal's time budget, and stops early once every one of the last LEARNED_STEPS
# steps was under LEARNED_LOSS. Small batches teach more per second: the target's attention
# shapes are kept, so a step's cost grows with its tokens, and the loss falls with the number of
# steps more than with their size (Kimi-K2.5's miniature, one thread, 60 s: batches of 8 reached
# loss 3.1 in 62 steps, of 4 0.95 in 117, of 2 0.40 in 195, of 1 0.42 in 269; batches of 2
# reached 0.08 in 470 steps, where the budget of 150 s with batches of 8 ended at 0.1 to 0.3).
# 300 steps (loss 0.45) were too few: one of 64 answers sampled at temperature 1 closed the
# turn inside the reasoning, which the template check rightly refused.
TEACH_STEPS, TEACH_BATCH = 450, 2
LEARNED_STEPS, LEARNED_LOSS = 20, 0.05


class MiniatureError(RuntimeError):
    pass


def shrink(text: dict) -> tuple[dict, list[str]]:
    """The text config at toy widths, and a line for every value changed."""
    out = {k: v for k, v in text.items() if k not in DROPPED}
    changes = [f"{k} dropped" for k in DROPPED if k in text]
    old_layers = text.get("num_hidden_layers")
    for key, value in {**WIDTHS, **EXPERT_COUNTS}.items():
        if out.get(key) is None:
            continue
        new = min(out[key], value) if key in EXPERT_COUNTS else value
        if new != out[key]:
            changes.append(f"{key} {out[key]} -> {new}")
            out[key] = new
    heads, kv = text.get("num_attention_heads"), text.get("num_key_value_heads")
    if heads and kv:  # keep grouped-query attention grouped
        out["num_key_value_heads"] = out["num_attention_heads"] if kv == heads else max(1, min(kv, 2))
        changes.append(f"num_key_value_heads {kv} -> {out['num_key_value_heads']}")
    if heads and "head_dim" not in text and not text.get("kv_lora_rank"):
        # no explicit head size: the target's hidden/heads, which the engine's kernels accept
        out["head_dim"] = text["hidden_size"] // heads
        changes.append(f"head_dim {out['head_dim']} kept (hidden_size/num_attention_heads)")
    if old_layers:
        out["num_hidden_layers"] = min(old_layers, LAYERS)
        changes.append(f"num_hidden_layers {old_layers} -> {out['num_hidden_layers']}")
        for key, value in text.items():  # per-layer lists (layer_types, ...) keep their head
            if isinstance(value, list) and len(value) == old_layers:
                out[key] = value[:out["num_hidden_layers"]]
    if isinstance(out.get("first_k_dense_replace"), int):
        out["first_k_dense_replace"] = min(out["first_k_dense_replace"], 1)
    out["torch_dtype"] = out["dtype"] = "float32"
    out["use_cache"] = True
    return out, changes


def tokenizer_files(source: Path) -> list[Path]:
    """The files of ``source`` a tokenizer and its chat template need (no weights)."""
    from eaglet.target import CONFIG_FILE_SUFFIXES

    return [p for p in sorted(source.iterdir())
            if p.is_file() and p.suffix in CONFIG_FILE_SUFFIXES and p.name != "config.json"
            and not p.name.endswith(".index.json")]


def build(source: Path, out: Path, *, trust_remote_code: bool, template_kwargs: dict | None,
          reasoning: bool, teach_seconds: float = 150.0, seed: int = 0) -> dict:
    """Write the miniature of the target whose files are in ``source`` to ``out`` (a model
    directory vLLM serves and eaglet reads), taught the chat format; return what was built."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # the config class transformers (or the target's own code) gives these files; a
    # wrapper's language model is its text config (transformers maps Kimi's kimi_k2 to
    # deepseek_v3 there, as vLLM does)
    full = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    text = full.get_text_config() if hasattr(full, "get_text_config") else full
    wrapped = text is not full
    small, changes = shrink(text.to_dict())
    out.mkdir(parents=True, exist_ok=True)
    for path in tokenizer_files(source):
        shutil.copy2(path, out / path.name)
    tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=trust_remote_code)
    small_config = type(text).from_dict(small)
    small_config.architectures = None  # the class transformers builds says it
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(small_config, dtype=torch.float32)
    if model.get_input_embeddings().weight.shape[0] < len(tokenizer):
        raise MiniatureError(f"the tokenizer has {len(tokenizer)} tokens, more than the "
                             f"config's vocab_size {small.get('vocab_size')}")
    sequences = format_samples(tokenizer, template_kwargs or {}, reasoning)
    taught = teach(model, sequences, teach_seconds)
    model.save_pretrained(out, safe_serialization=True)
    # the target's own generation config (its stop tokens: a chat turn ends at <|im_end|>,
    # not at the config's eos), which save_pretrained wrote over
    if (source / "generation_config.json").exists():
        shutil.copy2(source / "generation_config.json", out / "generation_config.json")
    info = {"architecture": type(model).__name__,
            "wrapper": getattr(full, "architectures", None) if wrapped else None,
            "parameters": sum(p.numel() for p in model.parameters()),
            "changes": changes, "taught": taught}
    (out / "miniature.json").write_text(json.dumps(info, indent=1))
    return info


def format_samples(tokenizer, template_kwargs: dict, reasoning: bool,
                   n: int = TEACH_SAMPLES) -> list[tuple[list[int], int]]:
    """Token ids of ``n`` conversations in the target's format, with the length of each
    one's prompt (the rendering with the generation prompt): recorded ShareGPT first turns,
    each answered from a small pool of short answers after a short reasoning where the run
    has a reasoning parser. A pool of common words, not each prompt's own answer: a toy
    model learns a few answers in minutes, and ends its turn after them; free text it only
    loops on, never closing the reasoning or the turn."""
    from eaglet.prompts import load_source
    from eaglet.template_check import render_conversation_ids, render_ids

    records, _ = load_source({"type": "sharegpt", "limit": 4 * n, "max_prompt_chars": 100})
    out = []
    for i, record in enumerate(records[:n]):
        # as generation records an answer; rendered as the template check renders it (a
        # template that blanks the last answer's reasoning gets it back where a model emits it)
        answer = {"messages": record["messages"], "content": ANSWERS[i % len(ANSWERS)],
                  "reasoning": REASONING[i % len(REASONING)] if reasoning else None,
                  "chat_template_kwargs": template_kwargs}
        prompt = render_ids(tokenizer, record["messages"], True, template_kwargs)
        whole = render_conversation_ids(tokenizer, answer)
        start = next((j for j, (a, b) in enumerate(zip(prompt, whole)) if a != b),
                     min(len(prompt), len(whole)))
        out.append((whole, start))
    return out


def teach(model, sequences: list[tuple[list[int], int]], seconds: float,
          steps: int = TEACH_STEPS, batch: int = TEACH_BATCH, lr: float = 1e-3) -> dict:
    """Train ``model`` on the answers of ``sequences`` (prompt tokens are context only) for
    ``steps`` steps, or about ``seconds`` if that ends first; return the steps, epochs and the
    first and last loss.

    Every token outside the answers' own shares one output row, ``other``, in the softmax
    (with the log of their count added to its logit), and gets that row afterwards: the
    softmax is then the whole vocabulary's, exactly, at the cost of the taught tokens' rows
    alone (a target's 160K rows in every step made it ten times slower). Its mass is trained
    down with the rest, so a run that samples (temperature 1) stays within the taught
    tokens; random rows left in place would hold most of it, and a stand-in tokenizer's
    vocabulary has holes there that decode to nothing. Tied embeddings share the rows, so
    their prompt tokens outside the answers all read ``other`` as input too."""
    import torch

    taught = torch.tensor(sorted({t for ids, start in sequences for t in ids[start:]}))
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    vocab = head.weight.shape[0]
    column = torch.full((max(vocab, embed.weight.shape[0]),), -1, dtype=torch.long)
    column[taught] = torch.arange(taught.numel())
    tied = head.weight.data_ptr() == embed.weight.data_ptr()
    out_rows = torch.nn.Parameter(head.weight.detach()[taught].clone())
    other = torch.nn.Parameter(head.weight.detach().mean(0))
    others = math.log(max(1, vocab - taught.numel())) + OTHER_MARGIN
    in_rows = out_rows if tied else torch.nn.Parameter(embed.weight.detach()[taught].clone())
    embed.weight.requires_grad_(False)
    head.weight.requires_grad_(False)
    threads = torch.get_num_threads()
    # one thread: the toy model's matrices are too small to share, and two threads spinning
    # beside a busy core ran a step ten times slower (110 steps in 90 s on one, 7 on two)
    torch.set_num_threads(1)
    model.train()
    params = ([p for p in model.parameters() if p.requires_grad] + [out_rows, other]
              + ([] if tied else [in_rows]))
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    # linear decay to a twentieth: steps of 2 sequences at a constant rate leave the last
    # steps' noise in the weights (Kimi-K2.5's miniature on one CPU ended its 450 steps at
    # loss 0.145 and sampled 5 of 64 answers at temperature 1 that closed the turn inside
    # their reasoning; on another at 0.067, with none)
    decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.05, 1 - s / steps))
    started, step, losses = time.monotonic(), 0, []
    order = list(range(len(sequences)))
    rng = random.Random(0)
    while step < steps and time.monotonic() - started < seconds:
        if step % math.ceil(len(order) / batch) == 0:
            rng.shuffle(order)
        chosen = [sequences[i] for i in order[(step * batch) % len(order):][:batch]]
        width = max(len(ids) for ids, _ in chosen)
        ids = torch.zeros(len(chosen), width, dtype=torch.long)
        labels = torch.full((len(chosen), width), -100, dtype=torch.long)
        mask = torch.zeros(len(chosen), width, dtype=torch.long)
        for row, (seq, start) in enumerate(chosen):
            ids[row, :len(seq)] = torch.tensor(seq)
            labels[row, start:len(seq)] = torch.tensor(seq[start:])
            mask[row, :len(seq)] = 1
        where = column[ids]
        rest = other.expand(*ids.shape, -1) if tied else embed.weight.detach()[ids]
        inputs = torch.where((where >= 0)[..., None], in_rows[where.clamp(min=0)], rest)
        hidden = model.get_decoder()(inputs_embeds=inputs, attention_mask=mask).last_hidden_state
        rows = labels[:, 1:] != -100
        states = hidden[:, :-1][rows]
        logits = torch.cat([states @ out_rows.T, (states @ other + others)[:, None]], dim=1)
        loss = torch.nn.functional.cross_entropy(logits.float(), column[labels[:, 1:][rows]])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        decay.step()
        losses.append(loss.item())
        step += 1
        if len(losses) >= LEARNED_STEPS and max(losses[-LEARNED_STEPS:]) < LEARNED_LOSS:
            break  # learned: decoding, sampled or greedy, follows them to the end of turn
        if step % 20 == 0:
            log.info("teaching step %d: loss %.3f (%.0f s)", step, losses[-1],
                     time.monotonic() - started)
    with torch.no_grad():
        # a tied head is the input embedding too: scaling it would change the inputs
        sharpen = 1.0 if tied else SHARPEN
        head.weight[:] = other.detach() * sharpen
        head.weight[taught] = out_rows.detach() * sharpen
        if not tied:
            embed.weight[taught] = in_rows.detach()
    embed.weight.requires_grad_(True)
    head.weight.requires_grad_(True)
    torch.set_num_threads(threads)
    model.eval()
    # the last steps' mean: one step of 2 sequences is a noisy reading
    last = sum(losses[-LEARNED_STEPS:]) / len(losses[-LEARNED_STEPS:])
    log.info("taught the chat format: %d steps in %.0f s, loss %.2f -> %.3f (the last %d "
             "steps' mean)", step, time.monotonic() - started, losses[0], last, LEARNED_STEPS)
    return {"steps": step, "samples": len(sequences), "answer_tokens": int(taught.numel()),
            "epochs": round(step * batch / len(sequences), 1),
            "loss_first": round(losses[0], 3), "loss_last": round(last, 3),
            "sharpened": sharpen}
