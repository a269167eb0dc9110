"""Tokenizer of the Kimi-K2.5 stand-in: a tiktoken byte-level BPE behind transformers'
slow-tokenizer interface, loaded the way the hub's ``tokenization_kimi.py`` is (through
``auto_map``, so only with ``trust_remote_code=True``).

Written for eaglet's tests from the published behaviour of Kimi's tokenizer, not from its
code. What it shares with the real one:

- the class name ``TikTokenTokenizer`` and the ranks file ``tiktoken.model``;
- Kimi's pre-tokenizer split (Han runs, words, numbers of up to three digits, ...);
- a block of 256 reserved ids for special tokens: those named in ``added_tokens_decoder``
  keep their ids and contents, the others are ``<|reserved_token_{id}|>``;
- ``encode(text)`` with no other argument reads special-token text as the special token
  and adds no BOS; ``decode(ids)`` with no other argument decodes every id as text;
- ``apply_chat_template`` defaults to ``tokenize=False, add_generation_prompt=True,
  thinking=True`` and sorts the keys of ``tools`` (the real one also renders ``tools`` as a
  TypeScript declaration, ``tools_ts_str``; this one leaves that variable unset, so the
  template declares tools as JSON).

What is shrunk: the ranks file holds a few thousand ordinary tokens, not 163,584. The
reserved block starts at the lowest id ``tokenizer_config.json`` names at or above the
ordinary tokens (163584 for Kimi), so every special token keeps its real id and the ids
between the ordinary tokens and the block are a gap that no text encodes to; such an id,
if a model samples it, decodes to the unknown token rather than failing.
"""

from __future__ import annotations

import json
import os
from shutil import copyfile
from typing import Any

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

RESERVED_SPECIAL_IDS = 256

_NOT_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NOT_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
SPLIT_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}*{_NOT_HAN_LOWER}+{_CONTRACTION}",
        rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}+{_NOT_HAN_LOWER}*{_CONTRACTION}",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)


def _sorted_keys(value: Any) -> Any:
    """``value`` with every mapping's keys in sorted order, so a tool schema renders the
    same whatever order a client wrote its fields in."""
    if isinstance(value, dict):
        return {key: _sorted_keys(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_sorted_keys(item) for item in value]
    return value


class TikTokenTokenizer(PreTrainedTokenizer):
    """Byte-level BPE over tiktoken ranks, with Kimi's special tokens at their ids."""

    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(
        self,
        vocab_file: str,
        bos_token="[BOS]",
        eos_token="[EOS]",
        unk_token=None,
        pad_token=None,
        additional_special_tokens=None,
        added_tokens_decoder=None,
        **kwargs,
    ):
        if not os.path.isfile(vocab_file):
            raise FileNotFoundError(f"tiktoken ranks file not found: {vocab_file}")
        self.vocab_file = vocab_file
        ranks = load_tiktoken_bpe(vocab_file)
        named = {
            int(index): str(getattr(token, "content", token))
            for index, token in (added_tokens_decoder or {}).items()
        }
        first = min((i for i in named if i >= len(ranks)), default=len(ranks))
        self.special_ids = {
            named.get(i, f"<|reserved_token_{i}|>"): i
            for i in range(first, first + RESERVED_SPECIAL_IDS)
        }
        self.model = tiktoken.Encoding(
            name=os.path.basename(vocab_file),
            pat_str=SPLIT_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.special_ids,
        )
        as_char = bytes_to_unicode()
        self._byte_of = {char: byte for byte, char in as_char.items()}
        self._token_of = {rank: "".join(as_char[b] for b in token) for token, rank in ranks.items()}
        self._token_of.update({i: text for text, i in self.special_ids.items()})
        self._id_of = {text: i for i, text in self._token_of.items()}
        if additional_special_tokens is None:
            additional_special_tokens = [
                "<|im_end|>",
                "<|im_user|>",
                "<|im_assistant|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "[EOT]",
                "<|im_system|>",
                "<|im_middle|>",
            ]
        super().__init__(
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
            pad_token=pad_token,
            additional_special_tokens=additional_special_tokens,
            added_tokens_decoder=added_tokens_decoder,
            **kwargs,
        )

    # -- the fast paths the hub tokenizer has: plain text in, ids out, specials read ----

    def encode(self, text, *args, **kwargs):
        """``encode(text)`` alone encodes with tiktoken directly: special-token text becomes
        the special token, no BOS is added. Any other argument takes transformers' path."""
        if args or kwargs or not isinstance(text, str):
            return super().encode(text, *args, **kwargs)
        return self.model.encode(text, allowed_special="all")

    def decode(self, token_ids, *args, **kwargs):
        """``decode(ids)`` alone decodes every id as text (special tokens included); any
        other argument (``skip_special_tokens``, ...) takes transformers' path."""
        if args or kwargs:
            return super().decode(token_ids, *args, **kwargs)
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self.convert_tokens_to_string([self._convert_id_to_token(int(i)) for i in ids])

    def apply_chat_template(
        self,
        conversation,
        tools=None,
        tokenize: bool = False,
        add_generation_prompt: bool = True,
        thinking: bool = True,
        **kwargs,
    ):
        """The hub tokenizer's defaults: text, not ids, with the generation prompt, thinking
        on. ``thinking=False`` is what turns thinking off in the template."""
        return super().apply_chat_template(
            conversation,
            tools=_sorted_keys(tools) if tools else tools,
            tokenize=tokenize,
            add_generation_prompt=add_generation_prompt,
            thinking=thinking,
            **kwargs,
        )

    # -- what transformers' slow-tokenizer base needs -------------------------------------

    @property
    def vocab_size(self) -> int:
        """One past the highest id: the size of the embedding the ids index."""
        return self.model.n_vocab

    def __len__(self) -> int:
        """One past the highest id, as the hub tokenizer's, where every id below it is a
        token: the stand-in's gap ids do not shrink it. (vLLM's detokenizer decodes an id at
        or past ``len(tokenizer)`` to nothing: with the gap left out, the special tokens
        above it, ``</think>`` among them, vanished from the served text.)"""
        return self.model.n_vocab

    def get_vocab(self) -> dict[str, int]:
        """Every token that exists (ordinary and special), as its byte-level string."""
        return dict(self._id_of)

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        """Byte-level strings of the BPE tokens of ``text`` (special tokens were split off
        before this is called, so none is read here)."""
        return [self._token_of[i] for i in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self._id_of.get(token, self.unk_token_id)

    def _convert_id_to_token(self, index: int) -> str:
        """The id's token; an id in the gap below the special block is the unknown token."""
        return self._token_of.get(index, str(self.unk_token))

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """Byte-level strings back to text; special tokens are their own text."""
        out, pending = [], bytearray()
        for token in tokens:
            if token in self.special_ids:
                out.append(pending.decode("utf-8", "replace"))
                pending.clear()
                out.append(token)
            else:
                pending.extend(self._byte_of[c] for c in token)
        out.append(pending.decode("utf-8", "replace"))
        return "".join(out)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None):
        """Copy the ranks file, the vocabulary this tokenizer was built from."""
        if not os.path.isdir(save_directory):
            raise ValueError(f"save_vocabulary needs an existing directory, got {save_directory}")
        name = (f"{filename_prefix}-" if filename_prefix else "") + "tiktoken.model"
        target = os.path.join(save_directory, name)
        if os.path.abspath(target) != os.path.abspath(self.vocab_file):
            copyfile(self.vocab_file, target)
        return (target,)

    def __repr__(self) -> str:
        return (
            f"TikTokenTokenizer(vocab_file={json.dumps(os.path.basename(self.vocab_file))}, "
            f"ordinary={len(self._token_of) - len(self.special_ids)}, "
            f"special_ids={min(self.special_ids.values())}..{max(self.special_ids.values())})"
        )
