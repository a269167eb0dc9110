"""Tests of eaglet.data.prompts: sources, bad rows, dedup, ids, split, stats and the script."""

from __future__ import annotations

import hashlib
import json
import logging
import runpy
from pathlib import Path
from types import SimpleNamespace

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eaglet.core.config import validate
from eaglet.core.io import read_json, read_jsonl
from eaglet.data.prompts import (
    HUMANEVAL_INSTRUCTION,
    PromptSourceError,
    load_source,
    prepare_prompts,
    prompt_id,
    split_score,
)
from tests.helpers.paths import REPO

SCRIPT = REPO / "scripts" / "prepare_prompts.py"


def data_config(*sources: dict, **data) -> dict:
    """The validated ``data`` section, defaults filled as the workflow passes it."""
    return validate({"data": {"sources": list(sources), **data}})["data"]


def source(**fields) -> dict:
    return data_config(fields)["sources"][0]


def write_jsonl_lines(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def text_file(tmp_path: Path, name: str, texts: list[str]) -> dict:
    path = write_jsonl_lines(tmp_path / name, [{"text": t} for t in texts])
    return source(type="file", path=str(path), text_field="text")


def run_prepare(
    tmp_path: Path, data_cfg: dict, tag: str = ""
) -> tuple[list[dict], list[dict], dict]:
    paths = [tmp_path / f"{name}{tag}" for name in ("train.jsonl", "eval.jsonl", "stats.json")]
    returned = prepare_prompts(data_cfg, *paths)
    assert read_json(paths[2]) == returned
    return read_jsonl(paths[0]), read_jsonl(paths[1]), returned


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# --------------------------------------------------------------------------- humaneval


def test_humaneval_yields_164_stable_chat_prompts():
    records, report = load_source(source(type="humaneval"))
    assert len(records) == report["rows"] == report["valid"] == 164
    assert report["bad"] == 0 and report["label"] == "humaneval"
    first = records[0]
    assert first["row"] == 1 and first["source"] == "humaneval"
    [message] = first["messages"]
    assert message["role"] == "user"
    assert message["content"].startswith(
        HUMANEVAL_INSTRUCTION + "\n\n```python\nfrom typing import List"
    )
    assert "def has_close_elements" in message["content"] and message["content"].endswith("```")
    # a changed wording or hash scheme changes every id downstream: pin one
    assert first["id"] == "p-9ee5a866c7ea5f38"
    assert len({r["id"] for r in records}) == 164
    assert [r["id"] for r in load_source(source(type="humaneval"))[0]] == [r["id"] for r in records]


def test_limit_reads_only_the_first_rows(tmp_path):
    records, report = load_source(source(type="humaneval", limit=5))
    assert [r["row"] for r in records] == [1, 2, 3, 4, 5] and report["rows"] == 5
    file_source = {**text_file(tmp_path, "t.jsonl", ["a", "b", "c"]), "limit": 2}
    assert [r["messages"] for r in load_source(file_source)[0]] == [user("a"), user("b")]


# --------------------------------------------------------------------------- file sources

ROWS = [
    {"question": "What is 2+2?", "sys": "Be brief.", "extra": 1},
    {"question": "Name a prime.", "sys": None},
    {"question": "Say hi.", "sys": "  "},
]
EXPECTED = [
    [{"role": "system", "content": "Be brief."}, *user("What is 2+2?")],
    user("Name a prime."),
    user("Say hi."),
]


def _write(path: Path, rows: list[dict]) -> None:
    if path.suffix == ".jsonl":
        write_jsonl_lines(path, rows)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_file_formats_map_text_and_system_fields(tmp_path, suffix):
    path = tmp_path / f"prompts{suffix}"
    _write(path, ROWS)
    file_source = source(type="file", path=str(path), text_field="question", system_field="sys")
    records, report = load_source(file_source)
    assert [r["messages"] for r in records] == EXPECTED
    assert [r["row"] for r in records] == [1, 2, 3]  # numbered as an editor shows them
    assert {r["source"] for r in records} == {f"file:{path}"}
    assert report == {"label": f"file:{path}", "rows": 3, "valid": 3, "bad": 0, "bad_examples": []}


def test_bad_rows_are_skipped_and_reported_with_row_numbers(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        "\n".join(
            [
                json.dumps({"text": "good one"}),
                json.dumps({"prompt": "wrong field"}),
                json.dumps({"text": ""}),
                "",  # blank lines are not rows, but keep the line numbering
                json.dumps({"text": " \n\t "}),
                json.dumps({"text": 42}),
                '{"text": "unterminated',
                json.dumps({"text": None}),
                json.dumps(["not", "an", "object"]),
                json.dumps({"text": "good two"}),
            ]
        )
        + "\n"
    )
    records, report = load_source(source(type="file", path=str(path), text_field="text"))
    assert [(r["row"], r["messages"]) for r in records] == [
        (1, user("good one")),
        (10, user("good two")),
    ]
    assert (report["rows"], report["valid"], report["bad"]) == (9, 2, 7)
    reasons = {e["row"]: e["reason"] for e in report["bad_examples"]}
    assert sorted(reasons) == [2, 3, 5, 6, 7, 8, 9]  # line numbers, as an editor shows them
    assert reasons[2] == "missing field 'text'"
    assert reasons[3] == reasons[5] == "field 'text' is empty"
    assert reasons[6] == "field 'text' is a int, not a string"
    assert reasons[7].startswith("invalid JSON")
    assert reasons[8] == "field 'text' is null, not a string"
    assert reasons[9] == "row is a list, not an object"


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_row_that_is_not_utf8_is_a_bad_row_and_the_good_rows_are_kept(tmp_path, suffix):
    path = tmp_path / f"latin1{suffix}"
    texts = ["one", "caf\u00e9", *[f"question {i}" for i in range(8)]]
    rows = [json.dumps({"text": t}, ensure_ascii=False).encode() for t in texts]
    rows[1] = rows[1].replace("\u00e9".encode(), b"\xe9")  # saved as Latin-1 by some editor
    path.write_bytes(
        b"".join(r + b"\n" for r in rows) if suffix == ".jsonl" else b"[" + b",\n".join(rows) + b"]"
    )
    data = data_config(source(type="file", path=str(path), text_field="text"), eval_fraction=0.5)
    train, held_out, stats = run_prepare(tmp_path, data)
    [counted] = stats["sources"]
    assert counted["label"] == f"file:{path}"
    assert (counted["rows"], counted["valid"], counted["bad"]) == (10, 9, 1)
    [example] = counted["bad_examples"]
    assert example["row"] == 2 and "not UTF-8" in example["reason"]
    assert sorted(p["messages"][0]["content"] for p in train + held_out) == sorted(
        texts[:1] + texts[2:]
    )


def test_a_lone_surrogate_is_a_bad_row_named_by_source_and_row(tmp_path):
    """JSON may escape half a UTF-16 pair ("\\ud800"): Python decodes it to a string that no
    UTF-8 writer accepts, which stopped the stage with a bare UnicodeEncodeError. It is a bad
    row like any other, counted and named; the good rows are kept."""
    path = tmp_path / "surrogate.jsonl"
    path.write_text('{"text": "good one"}\n{"text": "x \\ud800 y"}\n{"text": "good two"}\n')
    data = data_config(source(type="file", path=str(path), text_field="text"), eval_fraction=0.5)
    train, held_out, stats = run_prepare(tmp_path, data)
    [counted] = stats["sources"]
    assert (counted["rows"], counted["valid"], counted["bad"]) == (3, 2, 1)
    [example] = counted["bad_examples"]
    assert example["row"] == 2 and "lone surrogate" in example["reason"], example
    assert sorted(p["messages"][0]["content"] for p in train + held_out) == ["good one", "good two"]


def test_bad_examples_are_capped_but_all_bad_rows_counted(tmp_path):
    path = write_jsonl_lines(tmp_path / "x.jsonl", [{"text": ""}] * 30 + [{"text": "ok"}])
    _, report = load_source(source(type="file", path=str(path), text_field="text"))
    assert report["bad"] == 30 and len(report["bad_examples"]) == 20


def test_source_without_valid_prompt_names_source_rows_reasons_and_fields(tmp_path):
    path = write_jsonl_lines(
        tmp_path / "x.jsonl", [{"prompt": "a", "id": 1}, {"prompt": "b", "id": 2}]
    )
    with pytest.raises(PromptSourceError) as info:
        load_source(source(type="file", path=str(path), text_field="text"))
    message = str(info.value)
    assert f"file:{path}" in message
    assert "2 rows (2 bad)" in message
    assert "row 1: missing field 'text'" in message
    assert "check text_field='text'" in message and "['id', 'prompt']" in message


def test_empty_file_and_unparseable_file_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(PromptSourceError, match="no rows"):
        load_source(source(type="file", path=str(empty), text_field="text"))
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("nope\n{\n")
    with pytest.raises(PromptSourceError, match="invalid JSON.*check the file format"):
        load_source(source(type="file", path=str(garbage), text_field="text"))
    not_a_list = tmp_path / "obj.json"
    not_a_list.write_text('{"text": "a"}')
    with pytest.raises(PromptSourceError, match="expected a JSON list"):
        load_source(source(type="file", path=str(not_a_list), text_field="text"))


def test_missing_file_and_misconfigured_sources(tmp_path):
    missing = tmp_path / "nowhere.jsonl"
    with pytest.raises(PromptSourceError, match=f"not found: {missing}"):
        load_source(source(type="file", path=str(missing), text_field="text"))
    with pytest.raises(PromptSourceError, match="unsupported file extension '.csv'"):
        load_source(source(type="file", path=str(tmp_path / "x.csv"), text_field="text"))
    with pytest.raises(PromptSourceError, match="needs 'text_field'"):
        load_source(source(type="file", path=str(missing)))
    with pytest.raises(PromptSourceError, match="needs 'messages_field'"):
        load_source(source(type="conversations", path=str(missing)))


# --------------------------------------------------------------------------- conversations


def test_sharegpt_conversations(tmp_path):
    rows = [
        {
            "conversations": [
                {"from": "system", "value": "You are terse."},
                {"from": "human", "value": "Hi there"},
                {"from": "gpt", "value": "Hello"},
                {"from": "human", "value": "second turn is dropped"},
            ]
        },
        {
            "conversations": [
                {"from": "gpt", "value": "I speak first"},
                {"from": "system", "value": "not leading, so dropped"},
                {"from": "Human", "value": "Q2"},
            ]
        },
        {"conversations": [{"from": "gpt", "value": "only the bot"}]},
        {"conversations": [{"from": "human", "value": "   "}]},
        {"conversations": "not a list"},
    ]
    path = write_jsonl_lines(tmp_path / "sg.jsonl", rows)
    sharegpt = source(
        type="conversations",
        path=str(path),
        messages_field="conversations",
        role_field="from",
        content_field="value",
    )
    records, report = load_source(sharegpt)
    assert [r["messages"] for r in records] == [
        [{"role": "system", "content": "You are terse."}, *user("Hi there")],
        user("Q2"),
    ]
    assert records[0]["source"] == f"conversations:{path}"
    assert [(e["row"], e["reason"]) for e in report["bad_examples"]] == [
        (3, "no user message (roles: ['gpt'])"),
        (4, "message 0 content is empty"),
        (5, "field 'conversations' is a str, not a list"),
    ]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_openai_conversations(tmp_path, suffix):
    rows = [
        {
            "messages": [
                {"role": "user", "content": "No system here"},
                {"role": "assistant", "content": "ok"},
            ]
        },
        {
            "messages": [
                {"role": "system", "content": "Sys"},
                {"role": "user", "content": "With system"},
            ]
        },
    ]
    path = tmp_path / f"oa{suffix}"
    _write(path, rows)
    records, _ = load_source(
        source(type="conversations", path=str(path), messages_field="messages")
    )
    assert [r["messages"] for r in records] == [
        user("No system here"),
        [{"role": "system", "content": "Sys"}, *user("With system")],
    ]


def test_wrong_role_field_error_points_at_the_fields(tmp_path):
    path = write_jsonl_lines(
        tmp_path / "sg.jsonl", [{"conversations": [{"from": "human", "value": "hi"}]}]
    )
    with pytest.raises(PromptSourceError) as info:
        load_source(source(type="conversations", path=str(path), messages_field="conversations"))
    message = str(info.value)
    assert "message 0 has no field 'role' (fields: ['from', 'value'])" in message
    assert "role_field='role'" in message


# --------------------------------------------------------------------------- hf


def test_hf_source_via_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(name, subset=None, split=None):
        calls.append((name, subset, split))
        if name == "org/chat":
            return datasets.Dataset.from_list(
                [{"messages": [{"role": "user", "content": f"chat {i}"}]} for i in range(4)]
            )
        return datasets.Dataset.from_list([{"instruction": "Explain X"}, {"instruction": ""}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    records, report = load_source(source(type="hf", name="org/plain", text_field="instruction"))
    assert [r["messages"] for r in records] == [user("Explain X")]
    assert report["label"] == "hf:org/plain/train" and report["bad"] == 1
    records, report = load_source(
        source(
            type="hf",
            name="org/chat",
            subset="en",
            split="test",
            messages_field="messages",
            limit=3,
        )
    )
    assert [r["messages"] for r in records] == [user(f"chat {i}") for i in range(3)]
    assert report["label"] == "hf:org/chat:en/test"
    assert calls == [("org/plain", None, "train"), ("org/chat", "en", "test")]


# --------------------------------------------------------------------------- ids and dedup


def test_id_depends_only_on_normalized_content(tmp_path):
    from_file = load_source(text_file(tmp_path, "a.jsonl", ["Hello World"]))[0][0]
    variant = {"m": [{"role": "user", "content": "  hello\n\tWORLD "}]}
    path = write_jsonl_lines(tmp_path / "c.jsonl", [variant])
    from_chat = load_source(source(type="conversations", path=str(path), messages_field="m"))[0][0]
    assert from_file["id"] == from_chat["id"] == prompt_id(user("hello world"))
    assert from_file["id"].startswith("p-") and len(from_file["id"]) == 18
    assert prompt_id(user("hello world")) != prompt_id(user("hello  world!"))
    with_system = [{"role": "system", "content": "hello world"}, *user("x")]
    assert prompt_id(with_system) != prompt_id(user("hello world x"))
    assert prompt_id(user("ｈｅｌｌｏ world")) == prompt_id(user("hello world"))  # NFKC


def test_dedup_across_sources_first_occurrence_wins(tmp_path):
    first = text_file(
        tmp_path, "a.jsonl", ["Alpha beta", "gamma", "GAMMA ", *[f"a{i}" for i in range(20)]]
    )
    second = text_file(tmp_path, "b.jsonl", ["alpha   BETA", "delta", "Gamma"])
    train, held_out, stats = run_prepare(tmp_path, data_config(first, second, eval_fraction=0.3))
    prompts = train + held_out
    assert len(prompts) == len({p["id"] for p in prompts}) == 23
    kept = {p["messages"][0]["content"]: p for p in prompts}
    assert "alpha   BETA" not in kept and "Gamma" not in kept
    assert (
        kept["Alpha beta"]["source"] == f"file:{tmp_path / 'a.jsonl'}"
        and kept["Alpha beta"]["row"] == 1
    )
    assert [s["duplicates"] for s in stats["sources"]] == [1, 2]
    assert stats["totals"] == {"rows": 26, "valid": 26, "bad": 0, "duplicates": 3, "unique": 23}


# --------------------------------------------------------------------------- split


def _many(tmp_path: Path, name: str, n: int, prefix: str) -> dict:
    return text_file(tmp_path, name, [f"{prefix} question number {i}" for i in range(n)])


def test_split_score_is_the_documented_salted_hash():
    digest = hashlib.sha256(b"7:p-0123456789abcdef").hexdigest()
    assert split_score("p-0123456789abcdef", 7) == int(digest[:16], 16) / 16**16
    assert split_score("p-0123456789abcdef", 7) != split_score("p-0123456789abcdef", 8)


def test_split_is_disjoint_deterministic_sorted_and_hash_based(tmp_path):
    cfg = data_config(_many(tmp_path, "a.jsonl", 300, "a"), eval_fraction=0.2, seed=7)
    train, held_out, stats = run_prepare(tmp_path, cfg)
    train_ids, eval_ids = [p["id"] for p in train], [p["id"] for p in held_out]
    assert not set(train_ids) & set(eval_ids) and len(train_ids) + len(eval_ids) == 300
    assert train_ids == sorted(train_ids) and eval_ids == sorted(eval_ids)
    assert all(split_score(i, 7) < 0.2 for i in eval_ids) and all(
        split_score(i, 7) >= 0.2 for i in train_ids
    )
    assert 30 < len(eval_ids) < 90
    assert (stats["n_train"], stats["n_eval"], stats["eval_fraction"], stats["seed"]) == (
        len(train_ids),
        len(eval_ids),
        0.2,
        7,
    )
    before = [(tmp_path / n).read_bytes() for n in ("train.jsonl", "eval.jsonl", "stats.json")]
    run_prepare(tmp_path, cfg)
    assert [
        (tmp_path / n).read_bytes() for n in ("train.jsonl", "eval.jsonl", "stats.json")
    ] == before
    other_seed = run_prepare(tmp_path, {**cfg, "seed": 8}, tag=".seed8")[1]
    assert {p["id"] for p in other_seed} != set(eval_ids)


def test_adding_a_source_moves_no_prompt_between_splits(tmp_path):
    base = _many(tmp_path, "a.jsonl", 200, "a")
    train, held_out, _ = run_prepare(tmp_path, data_config(base, eval_fraction=0.25))
    extra = _many(tmp_path, "b.jsonl", 200, "b")
    train2, held_out2, _ = run_prepare(
        tmp_path, data_config(extra, base, eval_fraction=0.25), tag=".2"
    )
    assert {p["id"] for p in train} <= {p["id"] for p in train2}
    assert {p["id"] for p in held_out} <= {p["id"] for p in held_out2}
    assert len(train2) + len(held_out2) == 400


def _lowest_hashes(prompts: list[dict], n: int, seed: int) -> set[str]:
    return {p["id"] for p in sorted(prompts, key=lambda p: split_score(p["id"], seed))[:n]}


def test_caps_keep_the_lowest_hashes(tmp_path):
    prompts = _many(tmp_path, "a.jsonl", 200, "a")
    full_train, full_eval, _ = run_prepare(tmp_path, data_config(prompts, seed=3))
    cfg = data_config(prompts, seed=3, max_train_prompts=50, max_eval_prompts=4)
    train, held_out, stats = run_prepare(tmp_path, cfg, tag=".capped")
    assert (len(train), len(held_out), stats["n_train"], stats["n_eval"]) == (50, 4, 50, 4)
    assert {p["id"] for p in train} == _lowest_hashes(full_train, 50, seed=3)
    assert {p["id"] for p in held_out} == _lowest_hashes(full_eval, 4, seed=3)
    assert [p["id"] for p in train] == sorted(p["id"] for p in train)


def test_empty_split_is_an_error(tmp_path):
    cfg = data_config(text_file(tmp_path, "a.jsonl", ["only one prompt"]), eval_fraction=0.5)
    with pytest.raises(
        PromptSourceError, match=r"split is empty: 1 unique prompts.*change eval_fraction"
    ):
        run_prepare(tmp_path, cfg)
    assert not (tmp_path / "train.jsonl").exists()


# --------------------------------------------------------------------------- stats, logging, script


def test_stats_and_logging(tmp_path, caplog):
    good = text_file(tmp_path, "good.jsonl", [f"q{i}" for i in range(40)])
    mixed = write_jsonl_lines(
        tmp_path / "mixed.jsonl", [{"text": "q1"}, {"text": ""}, {"text": "new"}]
    )
    mixed_source = source(type="file", path=str(mixed), text_field="text")
    with caplog.at_level(logging.INFO, logger="eaglet.data.prompts"):
        _, _, stats = run_prepare(tmp_path, data_config(good, mixed_source))
    assert stats["sources"][1] == {
        "label": f"file:{mixed}",
        "rows": 3,
        "valid": 2,
        "bad": 1,
        "duplicates": 1,
        "bad_examples": [{"row": 2, "reason": "field 'text' is empty"}],
    }
    assert set(stats) >= {"sources", "totals", "n_train", "n_eval", "eval_fraction", "seed"}
    by_label = {r.getMessage().split(": ")[0]: r for r in caplog.records}
    assert by_label[f"file:{tmp_path / 'good.jsonl'}"].levelname == "INFO"
    warning = by_label[f"file:{mixed}"]
    assert warning.levelname == "WARNING"
    assert "3 rows, 2 valid, 1 bad, 1 duplicates" in warning.getMessage()
    assert "row 2: field 'text' is empty" in warning.getMessage()


def test_snakemake_script(tmp_path):
    cfg = data_config(_many(tmp_path, "a.jsonl", 50, "a"), eval_fraction=0.2)
    names = (("train", "jsonl"), ("eval", "jsonl"), ("stats", "json"))
    out = {name: str(tmp_path / "prompts" / f"{name}.{ext}") for name, ext in names}
    log = tmp_path / "logs" / "prepare_prompts.log"
    log.parent.mkdir()
    snakemake = SimpleNamespace(
        params=SimpleNamespace(data=cfg), output=SimpleNamespace(**out), log=[str(log)]
    )
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        runpy.run_path(str(SCRIPT), init_globals={"snakemake": snakemake})
    finally:
        for handler in set(root.handlers) - set(handlers):
            root.removeHandler(handler)
            handler.close()
        root.setLevel(level)
    stats = read_json(out["stats"])
    assert len(read_jsonl(out["train"])) == stats["n_train"]
    assert len(read_jsonl(out["eval"])) == stats["n_eval"]
    assert stats["n_train"] + stats["n_eval"] == 50
    assert "INFO eaglet.data.prompts: 50 unique prompts" in log.read_text()


def test_humaneval_tasks_ask_each_problem_several_ways():
    records, report = load_source(
        {"type": "humaneval", "tasks": ["complete", "explain", "test"], "limit": 6}
    )
    assert report["valid"] == 6 and len({r["id"] for r in records}) == 6
    openings = [r["messages"][0]["content"].split()[0] for r in records[:3]]
    assert openings == ["Complete", "Explain", "Write"]
    # the same problem asked the same way keeps its id whatever else is asked
    plain, _ = load_source({"type": "humaneval", "limit": 1})
    assert records[0]["id"] == plain[0]["id"]
    with pytest.raises(PromptSourceError, match="unknown tasks"):
        load_source({"type": "humaneval", "tasks": ["sing"]})


def sharegpt_record(i: int, turns: list[str]) -> dict:
    conversation = []
    for turn in turns:
        conversation += [{"from": "human", "value": turn}, {"from": "gpt", "value": "old answer"}]
    return {"id": f"c{i}", "conversations": conversation}


def test_truncated_json_list_keeps_complete_records_and_reports_the_tail(tmp_path, monkeypatch):
    import eaglet.data.prompts as prompts_module

    monkeypatch.setattr(prompts_module, "JSON_CHUNK_CHARS", 7)  # records span chunk borders
    records = [sharegpt_record(i, [f"question number {i}"]) for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = text.index('"c4"')  # the file stops inside the fifth record
    path = tmp_path / "truncated.json"
    path.write_text(text[:cut])
    prompts, report = load_source(source(type="sharegpt", path=str(path)))
    assert [p["messages"][-1]["content"] for p in prompts] == [
        f"question number {i}" for i in range(4)
    ]
    assert report["valid"] == 4 and report["bad"] == 1
    tail = report["bad_examples"][0]
    assert tail["row"] == 5 and "ends inside element 5" in tail["reason"]
    assert "4 complete elements before it are kept" in tail["reason"]


def test_json_list_cut_between_records_reports_the_missing_end(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text(json.dumps([sharegpt_record(0, ["a question"])])[:-1])  # no closing ]
    prompts, report = load_source(source(type="sharegpt", path=str(path)))
    assert len(prompts) == 1 and report["bad"] == 1
    assert "ends inside the list after 1 elements" in report["bad_examples"][0]["reason"]


def test_packaged_sharegpt_file_is_found_and_read_without_network():
    prompts, report = load_source(source(type="sharegpt", limit=50))
    assert report["label"] == "sharegpt" and report["rows"] == 50
    assert 0 < len(prompts) <= 50 and all(p["source"] == "sharegpt" for p in prompts)
    assert all(p["messages"][-1]["role"] == "user" for p in prompts)


def test_max_turns_keeps_later_user_turns_as_followups(tmp_path):
    path = tmp_path / "multi.json"
    path.write_text(
        json.dumps([sharegpt_record(0, ["first", "second", "third"]), sharegpt_record(1, ["only"])])
    )
    single, _ = load_source(source(type="sharegpt", path=str(path)))
    assert all("followups" not in p for p in single)
    multi, _ = load_source(source(type="sharegpt", path=str(path), max_turns=2))
    assert multi[0]["followups"] == ["second"]
    assert multi[0]["messages"] == [{"role": "user", "content": "first"}]
    assert multi[0]["id"] == single[0]["id"]  # the id hashes the first turn only
    assert "followups" not in multi[1]
    everything, _ = load_source(source(type="sharegpt", path=str(path), max_turns=10))
    assert everything[0]["followups"] == ["second", "third"]


def test_prompts_longer_than_max_prompt_chars_are_bad_rows(tmp_path):
    path = write_jsonl_lines(
        tmp_path / "p.jsonl", [{"text": "short question"}, {"text": "x" * 500}, {"text": "another"}]
    )
    prompts, report = load_source(
        source(type="file", path=str(path), text_field="text", max_prompt_chars=100)
    )
    assert [p["messages"][-1]["content"] for p in prompts] == ["short question", "another"]
    assert report["bad"] == 1 and report["bad_examples"][0] == {
        "row": 2,
        "reason": "prompt of 500 characters is longer than max_prompt_chars=100",
    }
    everything, _ = load_source(source(type="file", path=str(path), text_field="text"))
    assert len(everything) == 3


# -- answers: dataset -------------------------------------------------------------------------


def test_recorded_answers_are_kept_for_training_prompts_only(tmp_path):
    rows = [
        {
            "conversations": [
                {"from": "human", "value": f"Q{i}"},
                {"from": "gpt", "value": f"A{i}"},
                {"from": "human", "value": "later turns are not kept"},
            ]
        }
        for i in range(40)
    ]
    rows += [
        {"conversations": [{"from": "human", "value": "asked, never answered"}]},
        {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": " "}]},
    ]
    path = write_jsonl_lines(tmp_path / "sg.jsonl", rows)
    recorded = data_config(
        {"type": "sharegpt", "path": str(path), "answers": "dataset"}, eval_fraction=0.2
    )
    records, report = load_source(recorded["sources"][0])
    assert [(r["messages"], r["answer"]) for r in records[:2]] == [
        (user("Q0"), "A0"),
        (user("Q1"), "A1"),
    ]
    assert all("followups" not in r for r in records)
    # an answer is part of the row: a row without one is bad, not a prompt to generate for
    assert [(e["row"], e["reason"].split(" (")[0]) for e in report["bad_examples"]] == [
        (41, "no recorded answer right after the first user message"),
        (42, "message 1 content is empty"),
    ]
    # the same prompt ids (and so the same split) as without answers
    asked = load_source(source(type="sharegpt", path=str(path)))[0]
    assert [r["id"] for r in records] == [r["id"] for r in asked[:40]]
    train, held_out, stats = run_prepare(tmp_path, recorded)
    assert held_out and all("answer" not in p for p in held_out)  # the target answers these
    assert all(p["answer"] == "A" + p["messages"][0]["content"][1:] for p in train)
    assert stats["n_train_recorded_answers"] == len(train)


@pytest.mark.parametrize(
    "bad, why",
    [
        ({"type": "file", "text_field": "text"}, "needs recorded answers"),
        ({"type": "humaneval"}, "needs recorded answers"),
        ({"type": "sharegpt", "max_turns": 2}, "set max_turns: 1"),
    ],
)
def test_answers_dataset_needs_a_source_that_records_one_answer(tmp_path, bad, why):
    path = write_jsonl_lines(tmp_path / "x.jsonl", [{"text": "q"}])
    with pytest.raises(PromptSourceError, match=why):
        load_source(source(**bad, path=str(path), answers="dataset"))
