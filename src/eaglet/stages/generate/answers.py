"""The answers file and the settings an answer is made with.

The partial file (``<out>.partial.jsonl``) gets every finished record appended and flushed as
it arrives, and is read back by prompt id on a rerun (a torn or damaged line set aside); the
conversation helpers name each turn's record, build the next turn's history, and say which
turns of a prompt are still to ask. A record made with other settings (:class:`Sampling`, the
system prompt, the chat template's variables, capture) than the run's is asked again.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from eaglet.core.io import atomic_open

log = logging.getLogger("eaglet.stages.generate")


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    # None: not sent, so vLLM takes the target's generation_config.json value (its default)
    top_k: int | None = None
    min_p: float | None = None

    @classmethod
    def from_config(cls, gen: dict) -> Sampling:
        return cls(
            gen["temperature"],
            gen["top_p"],
            gen["max_tokens"],
            gen["seed"],
            gen.get("top_k"),
            gen.get("min_p"),
        )

    def settings(self) -> dict:
        """What a record keeps of its sampling: the settings sent. One left to the server's
        default is left out, so that answers recorded before eaglet had it still count as made
        with the same settings."""
        return {k: v for k, v in vars(self).items() if v is not None or k not in OPTIONAL}

    def request(self) -> dict:
        """The request's sampling fields (the seed apart: see chat_once)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
            **{k: getattr(self, k) for k in OPTIONAL if getattr(self, k) is not None},
        }


OPTIONAL = ("top_k", "min_p")  # Sampling's settings a server fills in when none is sent


# -- partial file ----------------------------------------------------------------------------


def read_partial(path: str | os.PathLike) -> dict[str, dict]:
    """Latest record per prompt id from a partial file.

    Every decodable line is kept. A line that does not decode (a torn last line from a kill
    mid-write, or a damaged one anywhere) is moved to ``<path>.bad`` and counted, and the
    file is rewritten without it so that appending continues cleanly.
    """
    path = Path(path)
    if not path.exists():
        return {}
    records: dict[str, dict] = {}
    good: list[bytes] = []
    bad: list[tuple[int, bytes]] = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            record = _decode_line(raw)
            if record is None:
                bad.append((number, raw))
                continue
            good.append(raw)
            previous = records.get(record["id"])
            if previous is None or "error" in previous or "error" not in record:
                records[record["id"]] = record
    if bad:
        _set_aside(path, good, bad)
    return records


def _decode_line(raw: bytes) -> dict | None:
    """The record on one whole line of a partial file, or None when it is not one."""
    if not raw.endswith(b"\n"):
        return None  # torn: the process was killed while writing it
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) and "id" in record else None


def _set_aside(path: Path, good: list[bytes], bad: list[tuple[int, bytes]]) -> None:
    """Append the bad lines to ``<path>.bad`` and rewrite ``path`` with the good ones."""
    side = path.with_name(path.name + ".bad")
    with open(side, "ab") as handle:
        for _, raw in bad:
            handle.write(raw if raw.endswith(b"\n") else raw + b"\n")
        handle.flush()
        os.fsync(handle.fileno())
    if len(bad) == 1 and bad[0][0] == len(good) + 1:
        with open(path, "r+b") as handle:  # only a torn or bad last line: cut it off
            handle.truncate(sum(len(raw) for raw in good))
    else:
        with atomic_open(path, "wb") as handle:
            handle.writelines(good)
    lines = ", ".join(str(number) for number, _ in bad[:10]) + (", ..." if len(bad) > 10 else "")
    log.warning(
        "%d undecodable line(s) of %s (line %s) set aside in %s; the %d good records are kept",
        len(bad),
        path,
        lines,
        side,
        len(good),
    )


def append_record(handle, record: dict) -> None:
    handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    handle.flush()
    os.fsync(handle.fileno())


# -- conversations ---------------------------------------------------------------------------


def turn_ids(prompt: dict) -> list[str]:
    """Record id of each turn a prompt asks: its own id for the first, then ``<id>.t<n>``
    for the user turns in ``followups`` (each answered after the target's earlier answers)."""
    return [prompt["id"]] + [
        f"{prompt['id']}.t{n}" for n in range(2, 2 + len(prompt.get("followups", [])))
    ]


def next_turn(messages: list[dict], answer: dict, user_text: str) -> list[dict]:
    """The history for the next turn: the target's own answer (its content; chat templates
    drop the reasoning of earlier turns), then the next user message."""
    return [
        *messages,
        {"role": "assistant", "content": answer.get("content") or ""},
        {"role": "user", "content": user_text},
    ]


def answer_settings(
    sampling: Sampling,
    template_kwargs: dict | None,
    capture: bool,
    system_prompt: str | list | None = None,
) -> dict:
    """What an answer was made with, beyond its prompt: a record made otherwise is asked
    again (a changed max_tokens, temperature, system prompt, template switch or capture
    reruns the stage, and the partial file must not hand it the old answers)."""
    return {
        "sampling": sampling.settings(),
        "chat_template_kwargs": template_kwargs or None,
        "capture": capture,
        "system_prompt": system_prompt or None,
    }


def made_with(record: dict) -> dict:
    return {
        "sampling": record.get("sampling"),
        "chat_template_kwargs": record.get("chat_template_kwargs") or None,
        "capture": "hidden_states" in record,
        "system_prompt": record.get("system_prompt") or None,
    }


def drop_stale(records: dict[str, dict], wanted: dict) -> dict[str, dict]:
    """The records answered with the ``wanted`` settings, plus failures and skips (which
    depend on none of them); the others are logged and left to be asked again."""
    kept = {rid: r for rid, r in records.items() if "sampling" not in r or made_with(r) == wanted}
    if len(kept) < len(records):
        log.info(
            "%d answers in the partial file were made with other generation settings "
            "(sampling, system prompt, chat template variables or capture): asked again",
            len(records) - len(kept),
        )
    return kept


def turns_left(prompt: dict, records: dict[str, dict]) -> int:
    """Turns of a prompt still to ask: none after a turn skipped as too long (the
    conversation ends there), else every turn from the first without an answer."""
    ids = turn_ids(prompt)
    for turn, record_id in enumerate(ids):
        record = records.get(record_id)
        if record is not None and "skipped" in record:
            return 0
        if record is None or "error" in record:
            return len(ids) - turn
    return 0
