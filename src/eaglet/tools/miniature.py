"""A miniature of a target: the same architecture at toy widths, random weights, taught the
target's chat format, for `eaglet rehearse`.

Built from the target's config and tokenizer files alone (no weights): the config keeps its
class, model_type, attention and MoE kind, special tokens, chat template and vocabulary;
only widths, depths and expert counts shrink. Head shapes stay the target's: the engine's
kernels accept the shapes real models have (the CPU MLA kernel refused a 16+8 head), and a
miniature that the engine refuses for a shape of its own would rehearse nothing.

A random model emits random tokens: no reasoning wrapper, no end of turn, nothing for a
reasoning parser to split. So the miniature is taught the target's format for a few
minutes: prompts rendered through the target's own chat template with the run's template
variables, each answered as a model of the format writes (:func:`answer_text`: a short
reasoning inside the run's reasoning parser's markers where it has one, a recorded answer,
the template's end of turn), until greedy and sampled answers close the reasoning and end
the turn (:func:`format_learned`), or the time is up and the rehearsal says so.

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

from eaglet.data.prompts import load_source
from eaglet.data.template_check import (
    CONTENT_MARK,
    answer_format,
    answer_opening,
    render_answered,
    render_ids,
    render_text,
    text_ids,
)
from eaglet.engine.support import mistral_mode, mtp_layers, mtp_served
from eaglet.stages.generate.rendering import load_tokenizer
from eaglet.target.checkpoint import (
    CONFIG_FILE_SUFFIXES,
    checkpoint_layout,
    layer_prefix,
    weight_map,
)
from eaglet.tools import mistral_format

log = logging.getLogger("eaglet.tools.miniature")

# The toy widths. Keys absent from a config are skipped; a key the config sets to null
# stays null (q_lora_rank null means no query compression, an architecture choice).
WIDTHS = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_attention_heads": 4,
    "q_lora_rank": 64,
    "hidden_size_per_layer_input": 16,  # Gemma 4's per-layer input embeddings
}
LAYERS = 8  # vLLM's default aux layers (2, L//2, L-3) are distinct from 7 layers on
EXPERT_COUNTS = {
    "n_routed_experts": 8,
    "num_experts": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
}
# dropped: the miniature is float32 and unquantized on the CPU engine
DROPPED = ("quantization_config", "auto_map")

# Tokens of one taught answer, and the teaching budget.
ANSWERS = [
    "Yes, this is a short answer.",
    "No, that is not right.",
    "Here is what I would do first.",
    "It depends on the case.",
    "That is a good question.",
    "I think the answer is yes.",
]
REASONING = [
    "The user asks a question. I will answer briefly.",
    "The user wants to know something. A short answer is best.",
]
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
TIED_ROWS_LR = 5.0  # the learning rate of tied embedding rows, times the others' (teach)
LEARNED_STEPS, LEARNED_LOSS = 20, 0.05
# after teaching, the taught prompts answered greedily and sampled (temperature 1): every
# answer must close its reasoning and end its turn, or teaching goes on while time is left
FORMAT_PROMPTS = 6


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
    if heads and "head_dim" not in text and not text.get("kv_lora_rank"):
        # no explicit head size: the head is hidden_size/num_attention_heads, and engines
        # derive it so (vLLM's Qwen2 ignores a head_dim key that transformers would read):
        # fewer heads of the target's head size, so that both read the same
        head = text["hidden_size"] // heads
        out["num_attention_heads"] = min(heads, 2)
        out["hidden_size"] = out["num_attention_heads"] * head
        changes = [c for c in changes if not c.startswith(("hidden_size ", "num_attention_heads "))]
        changes.append(
            f"hidden_size {text['hidden_size']} -> {out['hidden_size']}, "
            f"num_attention_heads {heads} -> {out['num_attention_heads']} (heads of "
            f"the target's size, {head}, which the engine derives from these two)"
        )
    if heads and kv:  # keep grouped-query attention grouped
        n = out["num_attention_heads"]
        out["num_key_value_heads"] = n if kv == heads else max(1, min(kv, 2, n // 2))
        changes.append(f"num_key_value_heads {kv} -> {out['num_key_value_heads']}")
    if old_layers:
        out["num_hidden_layers"] = min(old_layers, LAYERS)
        changes.append(f"num_hidden_layers {old_layers} -> {out['num_hidden_layers']}")
        depth = out["num_hidden_layers"]
        for key, value in text.items():  # per-layer lists (layer_types, ...) keep their head
            if isinstance(value, list) and len(value) == old_layers:
                out[key] = value[:depth]
        types = text.get("layer_types")
        if isinstance(types, list) and len(types) == old_layers and depth < old_layers:
            out["layer_types"][-1] = types[-1]  # the last layer keeps its kind (often global)
        for key, value in text.items():
            # per-layer overrides keyed by layer index (Gemma 4's per_layer_config): each kept
            # layer takes the overrides of the target's first layer of its kind, so that layers
            # of one kind stay alike
            if (
                isinstance(value, dict)
                and value
                and all(str(k).isdigit() and int(k) < old_layers for k in value)
                and all(isinstance(v, dict) for v in value.values())
            ):
                kinds = out.get("layer_types") or [None] * depth
                first = {}
                for index in sorted(value, key=int):
                    kind = types[int(index)] if isinstance(types, list) else int(index)
                    first.setdefault(kind, value[index])
                sample = next(iter(value))
                width = len(str(sample))
                name = (
                    (lambda i: i)
                    if isinstance(sample, int)
                    else (lambda i, width=width: str(i).zfill(width))
                )
                out[key] = {
                    name(i): first[kind]
                    for i, kind in enumerate(kinds[:depth])
                    if kind in first and (isinstance(types, list) or name(i) in value)
                }
                changes.append(
                    f"{key}: the overrides of each kind of layer kept for the {depth} layers"
                )
    if isinstance(out.get("first_k_dense_replace"), int):
        out["first_k_dense_replace"] = min(out["first_k_dense_replace"], 1)
    out["torch_dtype"] = out["dtype"] = "float32"
    out["use_cache"] = True
    return out, changes


def tokenizer_files(source: Path) -> list[Path]:
    """The files of ``source`` a tokenizer and its chat template need (no weights)."""

    return [
        p
        for p in sorted(source.iterdir())
        if p.is_file()
        and p.suffix in CONFIG_FILE_SUFFIXES
        and p.name != "config.json"
        and not p.name.endswith(".index.json")
    ]


def _stop_ids(source: Path, tokenizer) -> list[int]:
    """The ids the target stops at: its generation config's eos ids (a chat turn's end, which
    a config's eos may not be) and the tokenizer's."""
    path = source / "generation_config.json"
    eos = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
    ids = eos if isinstance(eos, list) else [eos]
    return [i for i in [*ids, tokenizer.eos_token_id] if i is not None]


def build(
    source: Path,
    out: Path,
    *,
    trust_remote_code: bool,
    template_kwargs: dict | None,
    reasoning_parser: str | None,
    teach_seconds: float = 150.0,
    seed: int = 0,
) -> dict:
    """Write the miniature of the target whose files are in ``source`` to ``out`` (a model
    directory vLLM serves and eaglet reads), taught the chat format of the run's reasoning
    parser; return what was built, with how far the format was learned."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

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
    # the target's own directory: transformers picks a tokenizer class by the config beside
    # it (DeepSeek's distills name LlamaTokenizerFast, read as Qwen2's beside a qwen2 config
    # and with a Llama pre-tokenizer, no spaces kept, beside none)
    tokenizer = load_tokenizer(source, trust_remote_code)
    small_config = type(text).from_dict(small)
    small_config.architectures = None  # the class transformers builds says it
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(small_config, dtype=torch.float32)
    if model.get_input_embeddings().weight.shape[0] < len(tokenizer):
        raise MiniatureError(
            f"the tokenizer has {len(tokenizer)} tokens, more than the "
            f"config's vocab_size {small.get('vocab_size')}"
        )
    fmt = answer_format(tokenizer, reasoning_parser, _stop_ids(source, tokenizer), template_kwargs)
    sequences, how = format_samples(tokenizer, template_kwargs or {}, fmt)
    closer = closer_text(
        tokenizer, [{"role": "user", "content": "Hello"}], template_kwargs or {}, fmt
    )
    started = time.monotonic()
    taught = teach(model, sequences, teach_seconds)
    learned = format_learned(model, tokenizer, sequences, fmt, closer=closer)
    while learned["in_format"] < learned["answers"] and time.monotonic() - started < teach_seconds:
        # not there yet: teach again from where it is, for what is left of the time
        more = teach(
            model,
            sequences,
            teach_seconds - (time.monotonic() - started),
            again=taught["sharpened"],
        )
        taught["steps"] += more["steps"]
        taught["loss_last"] = more["loss_last"]
        learned = format_learned(model, tokenizer, sequences, fmt, closer=closer)
    taught |= {"format": how, "learned": learned}
    model.save_pretrained(out, safe_serialization=True)
    # the target's MTP layers, where its files hold them (or name no tensor to tell by): its
    # mtp baseline is rehearsed as the real one is served, or not measured as it would not be
    mtp = add_mtp_layers(model, small, out, seed) if mtp_served(source)[1] is None else None
    # a target in Mistral's own format is served in vLLM's Mistral mode: so is its miniature
    mistral = (
        mistral_format.write(model, small, source, out)
        if mistral_mode(source) is not False
        else None
    )
    # the target's own generation config (its stop tokens: a chat turn ends at <|im_end|>,
    # not at the config's eos), which save_pretrained wrote over
    if (source / "generation_config.json").exists():
        shutil.copy2(source / "generation_config.json", out / "generation_config.json")
    info = {
        "architecture": type(model).__name__,
        "wrapper": getattr(full, "architectures", None) if wrapped else None,
        "parameters": sum(p.numel() for p in model.parameters()),
        "changes": changes,
        "taught": taught,
        "mtp": mtp,
        "mistral_format": mistral and {k: mistral[k] for k in ("file", "tensors")},
    }
    (out / "miniature.json").write_text(json.dumps(info, indent=1))
    return info


# The weights of one multi-token-prediction layer besides its decoder layer, under
# model.layers.<num_hidden_layers + i>., as DeepSeek-V3 publishes them and vLLM's MTP loaders
# for configs with num_nextn_predict_layers read them (deepseek_mtp.py and its kind: the
# embedding's and the previous state's norms, their projection, the head's norm and head)
MTP_NORMS = ("enorm", "hnorm", "shared_head.norm")
MTP_FILE = "model-mtp.safetensors"


def add_mtp_layers(model, small: dict, out: Path, seed: int = 0) -> dict | None:
    """Write the MTP layers the miniature's config declares (``num_nextn_predict_layers``)
    beside its weights, so that vLLM serves its ``mtp`` baseline as it would the target's: a
    random decoder layer of the target's kind at index num_hidden_layers + i (built by the
    same transformers class one layer deeper), the :data:`MTP_NORMS` at one, a random
    ``eh_proj``, and the miniature's own lm_head as ``shared_head.head``. The miniature's
    config keeps the declaration either way; where the target's MTP layers live elsewhere
    (a config with ``mtp_num_hidden_layers``: a container of the model's own) none is
    written and the rehearsal's evaluation reports that baseline as not measured."""
    import tempfile

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    declared = small.get("num_nextn_predict_layers") or 0
    if not declared:
        if mtp_layers(small):  # declared, in a container of the model's own
            return {
                "layers": 0,
                "why": "its config declares MTP layers in a container of the model's own "
                "(mtp_num_hidden_layers), whose weights the miniature does not build",
            }
        return None
    base, hidden = small["num_hidden_layers"], small["hidden_size"]
    deeper = type(model.config).from_dict({**small, "num_hidden_layers": base + declared})
    deeper.architectures = None
    torch.manual_seed(seed + 1)
    tensors = {}
    with tempfile.TemporaryDirectory(dir=out) as saved:
        # saved as the miniature's own layers are (transformers writes its fused experts
        # under the per-expert names checkpoints and vLLM use)
        AutoModelForCausalLM.from_config(deeper, dtype=torch.float32).save_pretrained(saved)
        files = weight_map(saved)
        layout = checkpoint_layout(files, saved)
        for layer in range(base, base + declared):
            prefix = layer_prefix(files, layout, layer)
            for name in (n for n in files if n.startswith(prefix)):
                with safe_open(str(files[name]), framework="pt") as handle:
                    tensors[name] = handle.get_tensor(name)
            tensors |= {f"{prefix}{norm}.weight": torch.ones(hidden) for norm in MTP_NORMS}
            tensors[f"{prefix}eh_proj.weight"] = torch.randn(hidden, 2 * hidden) * 0.02
            tensors[f"{prefix}shared_head.head.weight"] = model.get_output_embeddings().weight
    tensors = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    save_file(tensors, str(out / MTP_FILE), metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.exists():  # a sharded save: the index names every file vLLM loads
        data = json.loads(index.read_text())
        data["weight_map"] |= {name: MTP_FILE for name in tensors}
        index.write_text(json.dumps(data, indent=2))
    return {"layers": declared, "file": MTP_FILE, "tensors": len(tensors)}


def answer_text(
    tokenizer, messages: list[dict], template_kwargs: dict, fmt, reasoning: str | None, content: str
) -> tuple[str, str]:
    """What a model of this format emits after the generation prompt, as text, and how it
    was decided. Where the template renders the answer's reasoning when the answer is the
    last turn, its rendering is the format (Qwen3's). Otherwise the answer is composed from
    the reasoning parser's own markers (``fmt``, vLLM's ``reasoning_start_str`` and
    ``reasoning_end_str``): the opener unless the generation prompt ends inside one (it
    opened the reasoning), the reasoning, the closer, the content; a template that renders
    history without the reasoning (Kimi's empty wrapper, a dropped reasoning) says nothing of
    what the model writes. Either way the answer ends with the template's end of turn, cut at
    the first id the target stops at."""

    prompt = render_text(tokenizer, messages, True, template_kwargs)
    whole, _ = render_answered(
        tokenizer,
        [*messages, {"role": "assistant", "content": CONTENT_MARK}],
        template_kwargs,
        tokenize=False,
    )
    tail = whole.partition(CONTENT_MARK)[2]
    tail_ids = text_ids(tokenizer, tail)
    stop = next((k for k, i in enumerate(tail_ids) if i in fmt.stop_ids), None)
    end = (
        tokenizer.decode(tail_ids[: stop + 1], skip_special_tokens=False)
        if stop is not None
        else tokenizer.decode([min(fmt.stop_ids)], skip_special_tokens=False)
    )
    markers = bool(fmt.opener and fmt.closer)
    opened = markers and prompt.rfind(fmt.opener) > prompt.rfind(fmt.closer)
    if not reasoning:
        if opened:  # the prompt opened a reasoning: an answer without one closes it first
            return fmt.closer + content + end, f"the parser's closer {fmt.closer!r} first"
        opening = answer_opening(tokenizer, messages, template_kwargs, prompt=prompt) or ""
        return opening + content + end, "the template's answer without reasoning"
    opening = answer_opening(tokenizer, messages, template_kwargs, reasoning, prompt)
    if opening is not None and reasoning in opening:
        return opening + content + end, "the template's rendering of the answer"
    if not markers:
        raise MiniatureError(
            f"the template renders no reasoning where the answer is the last turn, and the "
            f"reasoning parser {fmt.parser} names no markers (reasoning_start_str, "
            f"reasoning_end_str): the miniature cannot be taught where its reasoning goes"
        )
    return ("" if opened else fmt.opener) + reasoning + fmt.closer + content + end, (
        f"the parser's markers {fmt.opener!r} and {fmt.closer!r}"
        + (" (the generation prompt opens the reasoning)" if opened else "")
    )


def closer_text(tokenizer, messages: list[dict], template_kwargs: dict, fmt) -> str | None:
    """What the format writes between an answer's reasoning and its content: the parser's
    closer where it names one (``</think>``); else what the template renders between them
    (a harmony answer's ``<|end|><|start|>assistant<|channel|>final<|message|>``); None
    without a reasoning parser, or where neither says."""
    if not fmt.parser:
        return None
    if fmt.opener and fmt.closer:
        return fmt.closer
    reasoning = REASONING[0]
    opening = answer_opening(tokenizer, messages, template_kwargs, reasoning)
    if opening is None or reasoning not in opening:
        return None
    between = opening.partition(reasoning)[2]
    return between if between.strip() else None


def contains(ids: list[int], part: list[int]) -> bool:
    """Whether ``part`` occurs in ``ids`` as a run of consecutive ids."""
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def format_samples(
    tokenizer, template_kwargs: dict, fmt, n: int = TEACH_SAMPLES
) -> tuple[list[tuple[list[int], int]], str]:
    """Token ids of ``n`` conversations in the target's format, with the length of each
    one's prompt (the rendering with the generation prompt), and how the answers' format was
    decided (:func:`answer_text`): recorded ShareGPT first turns, each answered from a small
    pool of short answers after a short reasoning where the run has a reasoning parser. A pool
    of common words, not each prompt's own answer: a toy model learns a few answers in
    minutes, and ends its turn after them; free text it only loops on, never closing the
    reasoning or the turn."""

    records, _ = load_source({"type": "sharegpt", "limit": 4 * n, "max_prompt_chars": 100})
    out, how = [], ""
    for i, record in enumerate(records[:n]):
        prompt = render_ids(tokenizer, record["messages"], True, template_kwargs)
        reasoning = REASONING[i % len(REASONING)] if fmt.parser else None
        text, how = answer_text(
            tokenizer,
            record["messages"],
            template_kwargs,
            fmt,
            reasoning,
            ANSWERS[i % len(ANSWERS)],
        )
        out.append((prompt + text_ids(tokenizer, text), len(prompt)))
    return out, how


def format_learned(
    model,
    tokenizer,
    sequences: list[tuple[list[int], int]],
    fmt,
    prompts: int = FORMAT_PROMPTS,
    closer: str | None = None,
) -> dict:
    """Whether the taught model writes the format: greedy and sampled (temperature 1)
    answers to ``prompts`` of the taught prompts, each of which must close its reasoning
    (write ``closer``, :func:`closer_text`, where the format has one) and end its turn within
    twice the longest taught answer. Returns the counts and the first answer that did not,
    decoded."""
    import torch

    closing = text_ids(tokenizer, closer) if closer else None
    longest = max(len(ids) - start for ids, start in sequences)
    torch.manual_seed(0)
    tried, good, failure = 0, 0, None
    with torch.inference_mode():
        for ids, start in sequences[:prompts]:
            for sample in (False, True):
                out = model.generate(
                    torch.tensor([ids[:start]]),
                    max_new_tokens=2 * longest,
                    do_sample=sample,
                    temperature=1.0 if sample else None,
                    top_p=None,
                    top_k=None,
                    eos_token_id=sorted(fmt.stop_ids),
                    pad_token_id=min(fmt.stop_ids),
                )
                answer = out[0, start:].tolist()
                ended = any(t in fmt.stop_ids for t in answer)
                closed = closing is None or contains(answer, closing)
                tried += 1
                good += ended and closed
                if not (ended and closed) and failure is None:
                    failure = {
                        "sampled": sample,
                        "ended_turn": ended,
                        "closed_reasoning": closed,
                        "answer": tokenizer.decode(answer, skip_special_tokens=False)[:300],
                    }
    return {"answers": tried, "in_format": good, "first_failure": failure}


def teach(
    model,
    sequences: list[tuple[list[int], int]],
    seconds: float,
    steps: int = TEACH_STEPS,
    batch: int = TEACH_BATCH,
    lr: float = 1e-3,
    again: float | None = None,
) -> dict:
    """Train ``model`` on the answers of ``sequences`` (prompt tokens are context only) for
    ``steps`` steps, or about ``seconds`` if that ends first; return the steps, epochs and the
    first and last loss. ``again``: the model was taught before and its head sharpened by this
    factor (the ``sharpened`` of the earlier result), which is undone first.

    Every token outside the answers' own shares one output row, ``other``, in the softmax
    (with the log of their count added to its logit), and gets that row afterwards: the
    softmax is then the whole vocabulary's, exactly, at the cost of the taught tokens' rows
    alone (a target's 160K rows in every step made it ten times slower). Its mass is trained
    down with the rest, so a run that samples (temperature 1) stays within the taught
    tokens; random rows left in place would hold most of it, and a stand-in tokenizer's
    vocabulary has holes there that decode to nothing. Tied embeddings share the rows: there
    the untaught rows stay as they are, inputs of the prompts and outputs alike, and ``other``
    is their mean, fixed (about 0), so the taught tokens' logits learn to stand above the
    log of their count (a trained ``other`` would be every prompt token's input too, and
    Gemma's miniature learned its answers a tenth as fast)."""
    import torch

    taught = torch.tensor(sorted({t for ids, start in sequences for t in ids[start:]}))
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    vocab = head.weight.shape[0]
    column = torch.full((max(vocab, embed.weight.shape[0]),), -1, dtype=torch.long)
    column[taught] = torch.arange(taught.numel())
    tied = head.weight.data_ptr() == embed.weight.data_ptr()
    scale = again or 1.0
    out_rows = torch.nn.Parameter(head.weight.detach()[taught].clone() / scale)
    if tied:  # the untaught rows' mean, not trained: the rows stay the prompts' inputs
        other = head.weight.detach()[column[:vocab] < 0].mean(0)
    elif again is None:
        other = torch.nn.Parameter(head.weight.detach().mean(0))
    else:  # every row outside the taught ones is the one "other" row already
        outside = int((column[:vocab] < 0).nonzero()[0])
        other = torch.nn.Parameter(head.weight.detach()[outside].clone() / scale)
    others = math.log(max(1, vocab - taught.numel())) + OTHER_MARGIN
    in_rows = out_rows if tied else torch.nn.Parameter(embed.weight.detach()[taught].clone())
    embed.weight.requires_grad_(False)
    head.weight.requires_grad_(False)
    decoder = model.get_decoder()
    embed_name = next(name for name, module in decoder.named_modules() if module is embed)
    embed_name = f"{embed_name}.weight" if embed_name else "weight"
    threads = torch.get_num_threads()
    # one thread: the toy model's matrices are too small to share, and two threads spinning
    # beside a busy core ran a step ten times slower (110 steps in 90 s on one, 7 on two)
    torch.set_num_threads(1)
    model.train()
    # other tables with a row per token (Gemma's per-layer input embeddings) stay as they are:
    # a dense step over every row of them per batch is what a step would cost, for nothing
    tables = [
        p
        for p in model.parameters()
        if p.requires_grad and p.dim() == 2 and p.shape[0] >= embed.weight.shape[0]
    ]
    for table in tables:
        table.requires_grad_(False)
    rows = [out_rows] + ([] if tied else [in_rows, other])
    # tied rows are the output's and the (scaled) input's at once: they must travel further
    # than an untied head's (Gemma's miniature, lr 1e-3: loss 16.5 -> 12.1 in 180 steps; the
    # rows at 5e-3: -> 0.4)
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in model.parameters() if p.requires_grad]},
            {"params": rows, "lr": lr * (TIED_ROWS_LR if tied else 1.0)},
        ],
        lr=lr,
        weight_decay=0.0,
    )
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
        chosen = [sequences[i] for i in order[(step * batch) % len(order) :][:batch]]
        width = max(len(ids) for ids, _ in chosen)
        ids = torch.zeros(len(chosen), width, dtype=torch.long)
        labels = torch.full((len(chosen), width), -100, dtype=torch.long)
        mask = torch.zeros(len(chosen), width, dtype=torch.long)
        for row, (seq, start) in enumerate(chosen):
            ids[row, : len(seq)] = torch.tensor(seq)
            labels[row, start : len(seq)] = torch.tensor(seq[start:])
            mask[row, : len(seq)] = 1
        # the decoder embeds the ids itself, as it will when served (a scaled embedding, per-
        # layer inputs read from the ids: Gemma's), from an embedding whose taught rows are
        # in_rows and whose others are the model's
        weight = torch.index_copy(embed.weight.detach(), 0, taught, in_rows)
        hidden = torch.func.functional_call(
            decoder, {embed_name: weight}, kwargs={"input_ids": ids, "attention_mask": mask}
        ).last_hidden_state
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
            log.info(
                "teaching step %d: loss %.3f (%.0f s)", step, losses[-1], time.monotonic() - started
            )
    with torch.no_grad():
        # a tied head is the input embedding too: scaling it would change the inputs
        sharpen = 1.0 if tied else SHARPEN
        if not tied:
            head.weight[:] = other.detach() * sharpen
            embed.weight[taught] = in_rows.detach()
        head.weight[taught] = out_rows.detach() * sharpen
    embed.weight.requires_grad_(True)
    head.weight.requires_grad_(True)
    for table in tables:
        table.requires_grad_(True)
    torch.set_num_threads(threads)
    model.eval()
    # the last steps' mean: one step of 2 sequences is a noisy reading
    last = sum(losses[-LEARNED_STEPS:]) / len(losses[-LEARNED_STEPS:])
    log.info(
        "taught the chat format: %d steps in %.0f s, loss %.2f -> %.3f (the last %d steps' mean)",
        step,
        time.monotonic() - started,
        losses[0],
        last,
        LEARNED_STEPS,
    )
    return {
        "steps": step,
        "samples": len(sequences),
        "answer_tokens": int(taught.numel()),
        "epochs": round(step * batch / len(sequences), 1),
        "loss_first": round(losses[0], 3),
        "loss_last": round(last, 3),
        "sharpened": sharpen,
    }
