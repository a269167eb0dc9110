"""The grammar a server holds every answer to, where its reasoning parser attaches one, and
what it then lets through of a drafter's drafts (for the offline replay).

vLLM 0.32's ``mistral`` reasoning parser, on a target whose Tekken tokenizer supports grammars
(v11 on), attaches to every chat request a lark grammar of its answer (an optional reasoning
in ``[THINK]``...``[/THINK]``, then content: ``parser/mistral.py adjust_request``), applied from
the first generated token. With speculative decoding the scheduler then keeps of each draft
only its longest prefix the grammar accepts after the tokens generated so far
(``v1/structured_output validate_tokens``): a draft cut to nothing is not a draft (no
drafting step counted), a shorter one counts its remaining tokens. The target never emits what
the grammar refuses, so such drafts would have been rejected anyway; but vLLM's counters count
fewer drafting steps than a replay that ignores the grammar.

Built with vLLM's own parts, as the server builds them: the parser's ``adjust_request`` for
the grammar, and its guidance backend (what vLLM picks for a lark grammar and a Tekken
tokenizer) for the matcher. Where the parser attaches no grammar, there is nothing to apply.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from eaglet.engine.support import mistral_mode

log = logging.getLogger("eaglet.engine.grammar")

# what a replay asks of a sequence (prompt ids, answer ids): a function from the row a round
# drafts from and its drafts to the drafts the server keeps
DraftFilter = Callable[[list[int], list[int]], Callable[[int, list[int]], list[int]]]


def parser_grammar(
    target_dir: str | Path, reasoning_parser: str | None, trust_remote_code: bool = False
):
    """The grammar ``reasoning_parser`` attaches to a chat request to the target in
    ``target_dir``, with the tokenizer vLLM serves it with; (None, None) where it attaches
    none."""
    if not reasoning_parser:
        return None, None
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.reasoning import ReasoningParserManager
    from vllm.tokenizers import get_tokenizer

    # Mistral's format where vLLM serves it so (or will, once the weights are there)
    mode = "auto" if mistral_mode(target_dir) is False else "mistral"
    tokenizer = get_tokenizer(
        str(target_dir), tokenizer_mode=mode, trust_remote_code=trust_remote_code
    )
    parser = ReasoningParserManager.get_reasoning_parser(reasoning_parser)(tokenizer)
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}])
    request = parser.adjust_request(request)
    if not getattr(request, "_grammar_from_parser", False) or request.structured_outputs is None:
        return None, None
    return request.structured_outputs.grammar, tokenizer


def draft_filter(
    target_dir: str | Path, reasoning_parser: str | None, trust_remote_code: bool = False
) -> DraftFilter | None:
    """What the server keeps of each draft, per sequence (module doc), or None where the
    run's reasoning parser attaches no grammar (or cannot be asked: the replay then counts
    every draft, as it did before)."""
    try:
        grammar, tokenizer = parser_grammar(target_dir, reasoning_parser, trust_remote_code)
    except Exception as error:  # a parser or tokenizer vLLM cannot build here
        log.warning(
            "could not ask the %s reasoning parser for the grammar it holds answers to "
            "(%s: %s): the replay counts every draft",
            reasoning_parser,
            type(error).__name__,
            error,
        )
        return None
    if grammar is None:
        return None
    import llguidance
    from vllm.v1.structured_output.backend_guidance import (
        GuidanceBackend,
        GuidanceGrammar,
        serialize_guidance_grammar,
    )
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions

    vocab_size = len(tokenizer)
    ll_tokenizer = GuidanceBackend._build_ll_tokenizer(tokenizer, vocab_size)
    serialized = serialize_guidance_grammar(StructuredOutputOptions.GRAMMAR, grammar, False, False)
    log.info(
        "the %s reasoning parser holds every answer to a grammar: the replay keeps of each "
        "draft what the server keeps",
        reasoning_parser,
    )

    def for_sequence(prompt_ids: list[int], completion_ids: list[int]):
        matcher = GuidanceGrammar(
            ll_matcher=llguidance.LLMatcher(ll_tokenizer, serialized),
            ll_tokenizer=ll_tokenizer,
            vocab_size=vocab_size,
        )
        answer = list(completion_ids)
        start = len(prompt_ids)
        consumed = 0  # answer tokens the grammar has taken

        def keep(row: int, drafts: list[int]) -> list[int]:
            # a round from row p follows every token up to p + 1 (the one the target just
            # produced): the grammar has taken them when vLLM checks the drafts
            nonlocal consumed
            upto = row + 2 - start
            if upto > consumed:
                matcher.accept_tokens("replay", answer[consumed:upto])
                consumed = upto
            return matcher.validate_tokens(list(drafts))

        return keep

    return for_sequence
