"""Write the gpt-oss stand-in's ``tokenizer.json`` from the o200k_harmony encoding that the
``openai_harmony`` package (a dependency of vLLM) carries compiled in: the real vocabulary, no
network.

    .venv/bin/python tests/standins/make_harmony_tokenizer.py tests/standins/gpt-oss-20b

Every ordinary token's bytes are read from the encoding (``decode_bytes``) at its rank, the
byte-level BPE merges follow from the ranks (transformers' tiktoken converter), the
pre-tokenizer split is o200k's public regular expression, and the encoding's special tokens
keep their ids (those below the config's ``vocab_size``: the model has rows for them alone).
Text encodes to the same ids as the encoding itself (tests/test_gpt_oss.py). The file is
28 MB, so it is built where it is needed rather than kept in the repository.
"""

from __future__ import annotations

import base64
import json
import sys
import tempfile
from pathlib import Path

# o200k's split: letter runs (cased words keep a leading non-letter and an English
# contraction), numbers of up to three digits, punctuation runs, newlines, spaces
O200K_SPLIT = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)


def encoding():
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)._inner


def build(directory: Path) -> Path:
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    inner = encoding()
    vocab_size = json.loads((directory / "config.json").read_text())["vocab_size"]
    specials = {
        name: inner.encode(name, allowed_special=[name])[0] for name in inner.special_tokens()
    }
    with tempfile.TemporaryDirectory() as tmp:
        ranks = Path(tmp) / "o200k_harmony.tiktoken"
        with open(ranks, "w") as out:
            for rank in range(min(specials.values())):
                token = bytes(inner.decode_bytes([rank]))
                out.write(f"{base64.b64encode(token).decode()} {rank}\n")
        tokenizer = TikTokenConverter(vocab_file=str(ranks), pattern=O200K_SPLIT).converted()
    tokenizer.add_special_tokens(
        [
            AddedToken(name, special=True, normalized=False)
            for name, i in sorted(specials.items(), key=lambda kv: kv[1])
            if i < vocab_size
        ]
    )
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return path


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
