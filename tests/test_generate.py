"""Generation client and resume bookkeeping, against a small real HTTP server in the test.

The server here speaks just enough of the OpenAI chat API to script failures (a 503 then a
success, a 400 that must not be retried); the real vLLM server is exercised end to end in
test_workflow_generate.py.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eaglet.core.io import request_path
from eaglet.engine.client import RequestFailed
from eaglet.stages.generate.answers import Sampling, read_partial
from eaglet.stages.generate.run import (
    GenerationSettings,
    build_messages,
    collect,
    generate,
    parse_response,
)

SAMPLING = Sampling(temperature=0.0, top_p=1.0, max_tokens=8, seed=0)


class ScriptedChat(BaseHTTPRequestHandler):
    """Answers each prompt with ids derived from its text; ``plan`` scripts failures."""

    plan: dict[str, list[int]] = {}  # prompt text -> status codes to return first
    calls: Counter = Counter()
    conversations: list[list[dict]] = []  # the messages of every request, in arrival order
    transfer: dict[str, dict | None] = {}  # prompt text -> the request's kv_transfer_params
    prefills: list[list[int]] = []  # the token ids of every prefill request
    template_kwargs: dict[str, dict | None] = {}  # prompt text -> its chat_template_kwargs
    seeds: dict[str, object] = {}  # prompt text -> its request's seed ("none": no seed sent)
    sampled: dict[str, dict] = {}  # prompt text -> its request's top_k and min_p, where sent
    capture_dir: Path | None = None  # set: a capturing server, saving every request's states

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(200, {"data": [{"id": "scripted"}]})

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/completions":  # a prefill request (token ids, one new token)
            return self._prefill(request)
        text = request["messages"][-1]["content"]
        ScriptedChat.calls[text] += 1
        ScriptedChat.conversations.append(request["messages"])
        ScriptedChat.transfer[text] = request.get("kv_transfer_params")
        ScriptedChat.template_kwargs[text] = request.get("chat_template_kwargs")
        ScriptedChat.seeds[text] = request.get("seed", "none")
        ScriptedChat.sampled[text] = {k: request[k] for k in ("top_k", "min_p") if k in request}
        if request.get("kv_transfer_params"):  # the connector saves after answering
            save_to = Path(request["kv_transfer_params"]["hidden_states_path"])
            threading.Timer(
                0.3,
                lambda: (
                    save_to.parent.mkdir(parents=True, exist_ok=True),
                    save_to.write_bytes(b"states"),
                ),
            ).start()
        statuses = ScriptedChat.plan.get(text, [])
        if statuses:
            status = statuses.pop(0)
            return self._send(status, {"error": f"scripted {status}"})
        assert request["return_token_ids"] is True
        assert request["spaces_between_special_tokens"] is False  # the text as the ids spell it
        body = {
            "prompt_token_ids": [1, 2, len(text)],
            "choices": [
                {
                    "message": {"content": text.upper(), "reasoning": None},
                    "token_ids": [ord(c) for c in text[:4]] + [2],
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 5},
        }
        if ScriptedChat.capture_dir is not None and not request.get("kv_transfer_params"):
            # a capturing server saves every request's states, at a path of its own choosing
            saved = ScriptedChat.capture_dir / f"req-{len(ScriptedChat.conversations)}.safetensors"
            threading.Timer(0.2, lambda: saved.write_bytes(b"states")).start()
            body["kv_transfer_params"] = {"hidden_states_path": str(saved)}
        self._send(200, body)

    def _prefill(self, request):
        ScriptedChat.prefills.append(request["prompt"])
        path = Path(request["kv_transfer_params"]["hidden_states_path"])
        if request["prompt"][0] == 666:  # a server without the capture options
            return self._send(200, {"choices": [{"text": "x"}]})
        threading.Timer(0.3, lambda: path.write_bytes(b"states")).start()
        self._send(
            200,
            {"choices": [{"text": "x"}], "kv_transfer_params": {"hidden_states_path": str(path)}},
        )


@pytest.fixture
def server():
    ScriptedChat.plan, ScriptedChat.calls, ScriptedChat.conversations = {}, Counter(), []
    ScriptedChat.transfer, ScriptedChat.template_kwargs, ScriptedChat.seeds = {}, {}, {}
    ScriptedChat.sampled, ScriptedChat.capture_dir = {}, None
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedChat)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def prompts(n: int) -> list[dict]:
    return [
        {
            "id": f"p-{i:016x}",
            "messages": [{"role": "user", "content": f"question {i}"}],
            "source": "test",
            "row": i,
        }
        for i in range(n)
    ]


def settings(url: str, **kw) -> GenerationSettings:
    return GenerationSettings(
        base_url=url,
        sampling=SAMPLING,
        concurrency=4,
        request_timeout_s=10,
        max_retries=kw.pop("max_retries", 2),
        **kw,
    )


def test_every_prompt_answered_once_with_token_ids(server, tmp_path):
    partial = tmp_path / "train.partial.jsonl"
    records = generate(prompts(10), settings(server), partial)
    assert len(records) == 10
    lines = [json.loads(line) for line in partial.read_text().splitlines()]
    assert sorted(r["id"] for r in lines) == sorted(p["id"] for p in prompts(10))
    one = records["p-0000000000000003"]
    assert one["completion_token_ids"] == [ord(c) for c in "ques"] + [2]
    assert one["prompt_token_ids"] == [1, 2, len("question 3")]
    assert one["content"] == "QUESTION 3" and one["model"] == "scripted"


def test_transient_errors_are_retried(server, tmp_path, monkeypatch):
    ScriptedChat.plan = {"question 0": [503, 429]}
    records = generate(prompts(2), settings(server, max_retries=2), tmp_path / "p.jsonl")
    assert "error" not in records["p-0000000000000000"]
    assert ScriptedChat.calls["question 0"] == 3


def test_permanent_error_is_recorded_and_does_not_stop_the_others(server, tmp_path):
    ScriptedChat.plan = {"question 1": [400, 400, 400]}
    records = generate(prompts(4), settings(server), tmp_path / "p.jsonl")
    assert "HTTP 400" in records["p-0000000000000001"]["error"]
    assert ScriptedChat.calls["question 1"] == 1  # a 400 is not retried
    assert all("error" not in records[p["id"]] for p in prompts(4) if p["row"] != 1)


def test_resume_skips_answered_prompts_and_retries_failed_ones(server, tmp_path):
    partial = tmp_path / "p.jsonl"
    ScriptedChat.plan = {"question 2": [400]}
    first = generate(prompts(3), settings(server), partial)
    assert "error" in first["p-0000000000000002"]
    ScriptedChat.calls.clear()

    second = generate(prompts(5), settings(server), partial)
    assert ScriptedChat.calls == Counter({"question 2": 1, "question 3": 1, "question 4": 1})
    for pid in ("p-0000000000000000", "p-0000000000000001"):  # not regenerated
        assert second[pid]["created_at"] == first[pid]["created_at"]
    assert "error" not in second["p-0000000000000002"]
    kept, counts = collect(prompts(5), read_partial(partial), keep_truncated=True)
    assert [r["id"] for r in kept] == [p["id"] for p in prompts(5)]
    assert counts["failed"] == 0


@pytest.mark.parametrize("model_name", [None, "target"])
def test_a_closed_server_url_port_names_the_url_and_what_to_check(tmp_path, model_name):
    import socket

    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    partial = tmp_path / "p.jsonl"
    with pytest.raises(RuntimeError) as err:
        generate(prompts(3), settings(url, model_name=model_name), partial)
    message = str(err.value)
    assert f"no server answers at {url}" in message and "server.url" in message
    assert not partial.exists() or partial.read_text() == ""  # no prompt marked as failed


def test_read_partial_drops_a_torn_last_line_and_appending_continues(tmp_path):
    partial = tmp_path / "p.jsonl"
    good = {"id": "p-a", "completion_token_ids": [1]}
    partial.write_text(json.dumps(good) + "\n" + '{"id": "p-b", "compl')
    assert read_partial(partial) == {"p-a": good}
    assert partial.read_text() == json.dumps(good) + "\n"


def test_read_partial_keeps_every_good_record_around_a_corrupt_middle_line(tmp_path, caplog):
    partial = tmp_path / "generate.partial.jsonl"
    rows = [{"id": f"p-{i}", "completion_token_ids": [i]} for i in range(6)]
    lines = [json.dumps(r) + "\n" for r in rows]
    bad = lines[2][:10] + "\x00garbage" + lines[2][10:]
    partial.write_text("".join(lines[:2]) + bad + "".join(lines[3:]))
    with caplog.at_level("WARNING", logger="eaglet.stages.generate"):
        records = read_partial(partial)
    assert set(records) == {f"p-{i}" for i in (0, 1, 3, 4, 5)}
    assert partial.read_text() == "".join(lines[:2] + lines[3:])  # appending continues cleanly
    side = tmp_path / "generate.partial.jsonl.bad"
    assert side.read_text() == bad  # set aside, not lost
    assert "1 undecodable line" in caplog.text and str(side) in caplog.text
    assert read_partial(partial) == records  # a second read finds nothing more to set aside
    assert side.read_text() == bad


def test_read_partial_prefers_an_answer_over_an_earlier_or_later_failure(tmp_path):
    partial = tmp_path / "p.jsonl"
    rows = [
        {"id": "p-a", "error": "x"},
        {"id": "p-a", "content": "ok"},
        {"id": "p-a", "error": "late"},
        {"id": "p-b", "error": "y"},
    ]
    partial.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = read_partial(partial)
    assert records["p-a"] == {"id": "p-a", "content": "ok"}
    assert records["p-b"]["error"] == "y"


def test_collect_counts_failures_and_truncation():
    ps = prompts(3)
    records = {
        ps[0]["id"]: {
            "id": ps[0]["id"],
            "finish_reason": "stop",
            "prompt_token_ids": [1, 2],
            "completion_token_ids": [3, 2],
        },
        ps[1]["id"]: {
            "id": ps[1]["id"],
            "finish_reason": "length",
            "prompt_token_ids": [1],
            "completion_token_ids": [4, 5, 6],
        },
        ps[2]["id"]: {"id": ps[2]["id"], "error": "HTTP 400"},
    }
    kept, counts = collect(ps, records, keep_truncated=True)
    assert len(kept) == 2 and counts["truncated"] == 1 and counts["failed"] == 1
    assert counts["completion_tokens"] == 5 and counts["prompt_tokens"] == 3
    kept, counts = collect(ps, records, keep_truncated=False)
    assert [r["id"] for r in kept] == [ps[0]["id"]] and counts["truncated_dropped"] == 1
    with pytest.raises(RuntimeError, match="no record"):
        collect(prompts(4), records, keep_truncated=True)


def test_parse_response_keeps_reasoning_under_either_name():
    body = {
        "prompt_token_ids": [1],
        "usage": {},
        "choices": [
            {
                "message": {"content": "a", "reasoning_content": "think"},
                "token_ids": [5],
                "finish_reason": "stop",
            }
        ],
    }
    assert parse_response(body)["reasoning"] == "think"
    body["choices"][0]["message"]["reasoning"] = "vllm 0.32 name"
    assert parse_response(body)["reasoning"] == "vllm 0.32 name"


def test_parse_response_without_token_ids_is_a_permanent_error():
    body = {"choices": [{"message": {"content": "a"}, "finish_reason": "stop"}]}
    with pytest.raises(RequestFailed, match="return_token_ids") as info:
        parse_response(body)
    assert not info.value.retryable


def test_system_prompt_added_only_where_missing():
    user = {"role": "user", "content": "q"}
    assert build_messages({"messages": [user]}, "be brief")[0] == {
        "role": "system",
        "content": "be brief",
    }
    own = [{"role": "system", "content": "mine"}, user]
    assert build_messages({"messages": own}, "be brief") == own
    assert build_messages({"messages": [user]}, None) == [user]


def conversation(i: int, followups: list[str]) -> dict:
    return {**prompts(i + 1)[i], "followups": followups}


def test_multi_turn_answers_every_turn_in_order_after_the_targets_own_answers(server, tmp_path):
    partial = tmp_path / "p.jsonl"
    convo = conversation(0, ["second ask", "third ask"])
    records = generate([convo], settings(server), partial)
    # each turn's history holds the target's earlier answers (the server upper-cases)
    assert ScriptedChat.conversations == [
        [{"role": "user", "content": "question 0"}],
        [
            {"role": "user", "content": "question 0"},
            {"role": "assistant", "content": "QUESTION 0"},
            {"role": "user", "content": "second ask"},
        ],
        [
            {"role": "user", "content": "question 0"},
            {"role": "assistant", "content": "QUESTION 0"},
            {"role": "user", "content": "second ask"},
            {"role": "assistant", "content": "SECOND ASK"},
            {"role": "user", "content": "third ask"},
        ],
    ]
    pid = convo["id"]
    assert sorted(records) == [pid, f"{pid}.t2", f"{pid}.t3"]
    assert records[f"{pid}.t3"]["turn"] == 3 and records[f"{pid}.t3"]["prompt_id"] == pid
    kept, counts = collect([convo], records, keep_truncated=True)
    assert [r["id"] for r in kept] == [pid, f"{pid}.t2", f"{pid}.t3"]  # all trained on
    assert counts["samples"] == 3 and counts["prompts"] == 1


def test_multi_turn_stops_at_a_failed_turn_and_resumes_from_it(server, tmp_path):
    partial = tmp_path / "p.jsonl"
    convo = conversation(0, ["second ask", "third ask"])
    ScriptedChat.plan = {"second ask": [400]}
    first = generate([convo], settings(server), partial)
    pid = convo["id"]
    assert "error" in first[f"{pid}.t2"] and f"{pid}.t3" not in first
    kept, counts = collect([convo], first, keep_truncated=True)
    assert counts["failed"] == 1 and counts["later_turns_not_asked"] == 1 and len(kept) == 1
    ScriptedChat.calls.clear()
    second = generate([convo], settings(server), partial)
    assert ScriptedChat.calls == Counter({"second ask": 1, "third ask": 1})  # turn 1 kept
    assert second[pid]["created_at"] == first[pid]["created_at"]
    assert [r["id"] for r in collect([convo], second, keep_truncated=True)[0]] == [
        pid,
        f"{pid}.t2",
        f"{pid}.t3",
    ]


def test_a_prompt_too_long_for_the_context_is_skipped_not_sent_and_not_a_failure(server, tmp_path):
    partial = tmp_path / "p.jsonl"
    convo = conversation(0, ["a follow-up far too long " * 50, "never asked"])
    short = prompts(2)[1]
    too_long = lambda messages: (
        "too long"
        if sum(len(m["content"]) for m in messages) > 200  # noqa: E731
        else None
    )
    records = generate([convo, short], settings(server), partial, too_long=too_long)
    pid = convo["id"]
    assert records[f"{pid}.t2"]["skipped"] == "too long" and f"{pid}.t3" not in records
    assert "follow-up" not in " ".join(ScriptedChat.calls)  # never sent to the server
    kept, counts = collect([convo, short], records, keep_truncated=True)
    assert [r["id"] for r in kept] == [pid, short["id"]]
    assert counts["failed"] == 0 and counts["too_long"] == 1
    assert counts["later_turns_not_asked"] == 1
    ScriptedChat.calls.clear()
    generate([convo, short], settings(server), partial, too_long=too_long)
    assert not ScriptedChat.calls  # a rerun asks nothing again: the conversation ended


def test_too_long_check_counts_the_chat_template_tokens():
    from eaglet.stages.generate.rendering import too_long_check
    from tests.test_template_check import PLAIN_TEMPLATE, make_tokenizer

    tokenizer = make_tokenizer(PLAIN_TEMPLATE)  # one token per byte
    messages = [{"role": "user", "content": "x" * 40}]
    rendered = len(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    assert too_long_check(tokenizer, rendered + 1)(messages) is None
    assert too_long_check(tokenizer, rendered)(messages) == (
        f"prompt of {rendered} tokens leaves no room within target.max_model_len={rendered}"
    )


def test_capture_asks_for_each_answers_states_at_the_path_extraction_reads(server, tmp_path):
    """generate.capture_hidden_states: every request (each turn of a conversation too) asks
    the server for the states of its prompt and output at the file the vllm extraction
    backend looks for that sample; without it no request carries kv_transfer_params."""
    capture = tmp_path / "requests"
    chat = conversation(0, ["and then?"])
    records = generate([chat], settings(server, capture_dir=str(capture)), tmp_path / "p.jsonl")
    first_id, second_id = chat["id"], chat["id"] + ".t2"
    assert set(records) == {first_id, second_id}
    first, second = (ScriptedChat.transfer[t] for t in ("question 0", "and then?"))
    assert first == {
        "include_output_tokens": True,
        "hidden_states_path": str(request_path(capture, first_id)),
    }
    assert second["hidden_states_path"] == str(request_path(capture, second_id))
    # a record is written once its states are: both files are there when generation returns
    assert request_path(capture, first_id).exists() and request_path(capture, second_id).exists()
    ScriptedChat.transfer = {}
    generate(prompts(2), settings(server), tmp_path / "q.jsonl")
    assert ScriptedChat.transfer == {"question 0": None, "question 1": None}


def test_recorded_answers_are_prefilled_on_the_capturing_server(server, tmp_path):
    """With capture on, the recorded answers (answers: dataset), which are never generated,
    get their states from the generation server too: one prefill request of the whole
    sample each, the files where extraction looks; those saved already are not sent again,
    and a server that saves nothing leaves them to extraction instead of failing."""
    from eaglet.core.config import validate
    from eaglet.stages.generate.run import prefill_recorded

    # the generate rule's config: generation's sections only (no extract.concurrency)
    cfg = {"generate": validate({})["generate"]}
    capture = tmp_path / "requests"
    capture.mkdir()
    recorded = [
        {"id": f"r{i}", "prompt_token_ids": [1, 2, i], "completion_token_ids": [7, i, 2]}
        for i in range(3)
    ]
    request_path(capture, "r0").write_bytes(b"saved before")
    ScriptedChat.prefills = []
    assert prefill_recorded(server, recorded, str(capture), cfg) == 2
    assert sorted(ScriptedChat.prefills) == [[1, 2, 1, 7, 1, 2], [1, 2, 2, 7, 2, 2]]
    assert all(request_path(capture, r["id"]).exists() for r in recorded)
    assert request_path(capture, "r0").read_bytes() == b"saved before"

    uncaptured = [{"id": "u", "prompt_token_ids": [666], "completion_token_ids": [2]}]
    assert prefill_recorded(server, uncaptured, str(capture), cfg) == 0
    assert not request_path(capture, "u").exists()


def test_template_variables_go_with_every_request_and_stay_in_every_record(server, tmp_path):
    switch = {"enable_thinking": False}
    records = generate(
        prompts(2), settings(server, chat_template_kwargs=switch), tmp_path / "p.jsonl"
    )
    assert ScriptedChat.template_kwargs == {"question 0": switch, "question 1": switch}
    assert all(r["chat_template_kwargs"] == switch for r in records.values())
    assert "kv_transfer_params" not in ScriptedChat.transfer  # no capture asked for


def test_requests_carry_the_seed_unless_the_engine_holds_it(server, tmp_path):
    generate(prompts(2), settings(server), tmp_path / "a.jsonl")
    assert ScriptedChat.seeds == {"question 0": 0, "question 1": 0}
    generate(prompts(2), settings(server, seed_per_request=False), tmp_path / "b.jsonl")
    assert ScriptedChat.seeds == {"question 0": "none", "question 1": "none"}


def test_top_k_and_min_p_go_with_requests_where_set_and_records_keep_them(server, tmp_path):
    """generate.top_k and min_p, as the target is served (Qwen3's thinking mode: top_k 20);
    unset they are not sent (the server's generation_config default), and answers recorded
    before eaglet had them still count as made with the same settings."""
    from eaglet.core.config import validate
    from eaglet.stages.generate.answers import Sampling, answer_settings, made_with

    gen = validate({"generate": {"temperature": 0.6, "top_k": 20, "min_p": 0.05}})["generate"]
    sampling = Sampling.from_config(gen)
    records = generate(
        prompts(1),
        GenerationSettings(
            base_url=server, sampling=sampling, concurrency=1, request_timeout_s=10, max_retries=0
        ),
        tmp_path / "a.jsonl",
    )
    assert ScriptedChat.sampled == {"question 0": {"top_k": 20, "min_p": 0.05}}
    assert records["p-0000000000000000"]["sampling"]["top_k"] == 20
    generate(prompts(1), settings(server), tmp_path / "b.jsonl")
    assert ScriptedChat.sampled == {"question 0": {}}
    unset = Sampling.from_config(validate({})["generate"])
    older = {"sampling": {"temperature": 0.0, "top_p": 1.0, "max_tokens": 512, "seed": 0}}
    assert made_with(older) == answer_settings(unset, None, False)
    assert made_with(older) != answer_settings(sampling, None, False)


@pytest.mark.parametrize(
    "temperature, gpus, per_request, args",
    [
        (1.0, 0, False, ["--seed", "7"]),  # sampled on vLLM's CPU engine: the engine is seeded
        (0.0, 0, True, []),  # greedy: no generator is drawn from
        (1.0, 8, True, []),  # GPU generators rewind; each request keeps its seed
    ],
)
def test_sampled_answers_on_the_cpu_engine_are_seeded_by_the_engine(
    temperature, gpus, per_request, args
):
    """vLLM's CPU engine died (CPU Generator does not use offset) when a seeded request's
    long prompt was prefilled over two steps: there the server takes generate.seed."""
    from eaglet.core.config import validate
    from eaglet.stages.generate.run import engine_seeding

    cfg = validate({"generate": {"temperature": temperature, "seed": 7}, "server": {"gpus": gpus}})
    assert engine_seeding(cfg) == (per_request, args)


def test_answers_made_with_other_settings_are_asked_again(server, tmp_path):
    """A changed max_tokens (or template switch, or capture) reruns the stage: the partial
    file's answers made otherwise are not handed back as finished."""
    partial = tmp_path / "p.jsonl"
    generate(prompts(3), settings(server), partial)
    assert sum(ScriptedChat.calls.values()) == 3
    generate(prompts(3), settings(server), partial)  # same settings: nothing asked
    assert sum(ScriptedChat.calls.values()) == 3
    longer = Sampling(temperature=0.0, top_p=1.0, max_tokens=16, seed=0)
    records = generate(
        prompts(3),
        GenerationSettings(
            base_url=server, sampling=longer, concurrency=4, request_timeout_s=10, max_retries=0
        ),
        partial,
    )
    assert sum(ScriptedChat.calls.values()) == 6
    assert all(r["sampling"]["max_tokens"] == 16 for r in records.values())
    generate(prompts(3), settings(server, chat_template_kwargs={"enable_thinking": False}), partial)
    assert sum(ScriptedChat.calls.values()) == 9
    generate(prompts(3), settings(server, system_prompt="Be brief."), partial)
    assert sum(ScriptedChat.calls.values()) == 12


# -- answers: dataset -------------------------------------------------------------------------


def test_recorded_answers_become_samples_without_asking_any_server(tmp_path):
    """Every training prompt has a recorded answer: the stage renders each through the chat
    template as the server would, ends it at the end-of-turn id, cuts it at max_tokens, and
    passes the template check, with no server at all (server.url points nowhere)."""
    from eaglet.core.config import validate
    from eaglet.core.io import read_json, read_jsonl, write_json, write_jsonl
    from eaglet.stages.generate.stage import run_stage
    from tests.test_template_check import PLAIN_TEMPLATE, make_tokenizer

    tokenizer = make_tokenizer(PLAIN_TEMPLATE)
    tokenizer.save_pretrained(tmp_path / "target")
    write_json(tmp_path / "target.json", {"path": str(tmp_path / "target"), "spec": "t"})
    answers = ["Four.", "x" * 50]
    write_jsonl(tmp_path / "train.jsonl", [{**p, "answer": a} for p, a in zip(prompts(2), answers)])
    cfg = validate(
        {
            "server": {"url": "http://127.0.0.1:9"},
            "generate": {"max_tokens": 20, "system_prompt": "Be brief."},
        }
    )
    run_stage(
        cfg,
        str(tmp_path / "target.json"),
        {"train": str(tmp_path / "train.jsonl")},
        {"train": str(tmp_path / "out.jsonl")},
        str(tmp_path / "stats.json"),
        str(tmp_path / "partial.jsonl"),
        None,
        None,
        str(tmp_path / "server.log"),
    )
    short, cut = read_jsonl(tmp_path / "out.jsonl")
    messages = [{"role": "system", "content": "Be brief."}, *prompts(1)[0]["messages"]]
    assert short["messages"] == messages and short["model"] == "dataset"
    assert short["prompt_token_ids"] == tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    # the answer's ids and the end-of-turn id, not the newline the template renders after it
    assert short["completion_token_ids"] == tokenizer.encode("Four.", add_special_tokens=False) + [
        end
    ]
    assert short["finish_reason"] == "stop" and short["content"] == "Four."
    assert cut["completion_token_ids"] == tokenizer.encode("x" * 20, add_special_tokens=False)
    assert cut["finish_reason"] == "length"
    stats = read_json(tmp_path / "stats.json")
    assert stats["dataset_answers"] == 2 and stats["template_check"]["mismatched"] == 0
    assert stats["splits"]["train"]["truncated"] == 1


def test_recorded_answers_prompts_are_rendered_by_the_server_and_kept(server, tmp_path):
    """vLLM's rendering is the prompts' reference: a recorded answer's prompt is sent to the
    server for one token, whose prompt ids replace the chat template's; they are kept, so a
    rerun with no server up trains on the same ids; the template's difference is reported,
    not counted as a mismatch."""
    from eaglet.core.config import validate
    from eaglet.core.io import read_json, read_jsonl, write_json, write_jsonl
    from eaglet.stages.generate.stage import run_stage
    from tests.test_template_check import PLAIN_TEMPLATE, make_tokenizer

    make_tokenizer(PLAIN_TEMPLATE).save_pretrained(tmp_path / "target")
    write_json(tmp_path / "target.json", {"path": str(tmp_path / "target"), "spec": "t"})
    train, held_out = prompts(2)
    write_jsonl(tmp_path / "train.jsonl", [{**train, "answer": "Four."}])
    write_jsonl(tmp_path / "eval.jsonl", [held_out])

    def stage(url: str) -> dict:
        cfg = validate(
            {
                "server": {"url": url},
                "generate": {"max_tokens": 20, "max_template_mismatch_rate": 1.0},
            }
        )
        run_stage(
            cfg,
            str(tmp_path / "target.json"),
            {"train": str(tmp_path / "train.jsonl"), "eval": str(tmp_path / "eval.jsonl")},
            {"train": str(tmp_path / "out.jsonl"), "eval": str(tmp_path / "out_eval.jsonl")},
            str(tmp_path / "stats.json"),
            str(tmp_path / "partial.jsonl"),
            None,
            None,
            str(tmp_path / "server.log"),
        )
        return read_json(tmp_path / "stats.json")

    stats = stage(server)
    (recorded,) = read_jsonl(tmp_path / "out.jsonl")
    # the scripted server renders every prompt as [1, 2, len(last message)]
    assert recorded["prompt_token_ids"] == [1, 2, len("question 0")]
    assert recorded["prompt_rendered_by"] == "server" and recorded["model"] == "dataset"
    assert ScriptedChat.calls["question 0"] == 1  # one request, for its rendering
    check = stats["template_check"]
    assert check["template_differs"] == 2 and check["template_first_difference"]
    assert all(m["part"] != "prompt" for m in check["mismatches"])
    # a rerun with no server: the kept rendering, not the template's
    (tmp_path / "out.jsonl").unlink()
    stage("http://127.0.0.1:9")
    assert read_jsonl(tmp_path / "out.jsonl")[0]["prompt_token_ids"] == [1, 2, len("question 0")]


def test_rendering_on_a_capturing_server_leaves_no_states_behind(server, tmp_path):
    """A capturing server saves the states of every request, the one-token rendering of a
    recorded answer's prompt too: those files are no sample's and are removed once written
    (they were left among the samples' states, for training to find)."""
    from eaglet.core.config import validate
    from eaglet.stages.generate.rendering import render_on_server

    ScriptedChat.capture_dir = tmp_path / "requests"
    ScriptedChat.capture_dir.mkdir()
    recorded = {p["id"]: {**p, "model": "dataset"} for p in prompts(3)}
    assert (
        render_on_server(server, recorded, tmp_path / "rendered.jsonl", validate({})["generate"])
        == 3
    )
    assert all(r["prompt_rendered_by"] == "server" for r in recorded.values())
    assert not list(ScriptedChat.capture_dir.iterdir())


def test_a_template_that_raises_for_some_prompts_is_said_with_them_before_any_server(tmp_path):
    """A chat template that raises for some prompts (here: a system message it refuses)
    stopped generation after the server started, with the template's own text alone. Every
    prompt is rendered first: those that fail are named with their source and row, and no
    server is asked (server.url points nowhere)."""
    from eaglet.core.config import validate
    from eaglet.core.io import write_json, write_jsonl
    from eaglet.stages.generate.rendering import TemplateError
    from eaglet.stages.generate.stage import run_stage
    from tests.test_template_check import PLAIN_TEMPLATE, make_tokenizer

    strict = (
        "{% for m in messages %}{% if m.role == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}{% endfor %}" + PLAIN_TEMPLATE
    )
    make_tokenizer(strict).save_pretrained(tmp_path / "target")
    write_json(tmp_path / "target.json", {"path": str(tmp_path / "target"), "spec": "t"})
    rows = prompts(3)
    rows[1]["messages"] = [{"role": "system", "content": "Be brief."}, *rows[1]["messages"]]
    write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = validate({"server": {"url": "http://127.0.0.1:9"}})
    with pytest.raises(TemplateError) as info:
        run_stage(
            cfg,
            str(tmp_path / "target.json"),
            {"train": str(tmp_path / "train.jsonl")},
            {"train": str(tmp_path / "out.jsonl")},
            str(tmp_path / "stats.json"),
            str(tmp_path / "partial.jsonl"),
            None,
            None,
            str(tmp_path / "server.log"),
        )
    message = str(info.value)
    assert "chat template cannot render 1 of 3 prompts" in message
    assert f"{rows[1]['id']} (test, row 1): TemplateError: System role not supported" in message
    assert not (tmp_path / "partial.jsonl").exists()


def test_a_template_that_renders_answers_apart_from_the_prompt_is_refused():
    from eaglet.stages.generate.rendering import dataset_record
    from tests.test_template_check import PLAIN_TEMPLATE, make_tokenizer

    # the generation prompt opens a "bot" turn, an answer renders as an "assistant" one
    tokenizer = make_tokenizer(
        PLAIN_TEMPLATE.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>bot\n{% endif %}")
    )
    gen = {"chat_template_kwargs": None, "system_prompt": None, "max_tokens": 8}
    with pytest.raises(RuntimeError, match="use answers: target"):
        dataset_record({**prompts(1)[0], "answer": "A"}, tokenizer, gen, {0})


# -- the target's tokenizer ---------------------------------------------------------------------


def tokenizer_shipped_as_code(directory: Path) -> Path:
    """A target tokenizer that is code: its class lives in a tokenization_*.py beside it,
    named by auto_map in tokenizer_config.json (as Kimi's tiktoken tokenizer is)."""
    from tests.test_template_check import PLAIN_TEMPLATE, make_tokenizer

    make_tokenizer(PLAIN_TEMPLATE).save_pretrained(directory)
    (directory / "tokenization_tiny.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class TinyTokenizer(PreTrainedTokenizerFast):\n"
        "    shipped_with_the_model = True\n"
    )
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(
        tokenizer_class="TinyTokenizer",
        auto_map={"AutoTokenizer": ["tokenization_tiny.TinyTokenizer", None]},
    )
    config_path.write_text(json.dumps(config))
    return directory


@pytest.fixture
def private_modules_cache(tmp_path, monkeypatch):
    """transformers copies a model's code into its modules cache: keep it in the test's dir."""
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))


def test_a_tokenizer_shipped_as_code_loads_only_when_the_config_trusts_it(
    tmp_path, private_modules_cache
):
    from eaglet.stages.generate.rendering import load_tokenizer

    path = tokenizer_shipped_as_code(tmp_path / "target")
    tokenizer = load_tokenizer(path, trust_remote_code=True)
    assert type(tokenizer).__name__ == "TinyTokenizer" and tokenizer.shipped_with_the_model
    assert tokenizer.decode(tokenizer.encode("hi <|im_end|>")) == "hi <|im_end|>"
    with pytest.raises(RuntimeError, match=r"set target\.trust_remote_code: true"):
        load_tokenizer(path, trust_remote_code=False)


def test_the_generate_stage_loads_the_tokenizer_with_the_targets_trust_remote_code(
    tmp_path, private_modules_cache
):
    """run_stage passes target.trust_remote_code to the tokenizer it loads (recorded answers
    need no server, so the stage runs to its end here)."""
    from eaglet.core.config import validate
    from eaglet.core.io import read_jsonl, write_json, write_jsonl
    from eaglet.stages.generate.stage import run_stage

    path = tokenizer_shipped_as_code(tmp_path / "target")
    write_json(tmp_path / "target.json", {"path": str(path), "spec": "t"})
    write_jsonl(tmp_path / "train.jsonl", [{**prompts(1)[0], "answer": "Four."}])

    def run(trust: bool) -> None:
        cfg = validate(
            {"target": {"trust_remote_code": trust}, "server": {"url": "http://127.0.0.1:9"}}
        )
        run_stage(
            cfg,
            str(tmp_path / "target.json"),
            {"train": str(tmp_path / "train.jsonl")},
            {"train": str(tmp_path / "out.jsonl")},
            str(tmp_path / "stats.json"),
            str(tmp_path / "partial.jsonl"),
            None,
            None,
            str(tmp_path / "server.log"),
        )

    with pytest.raises(RuntimeError, match=r"target\.trust_remote_code"):
        run(trust=False)
    assert not (tmp_path / "out.jsonl").exists()
    run(trust=True)
    assert read_jsonl(tmp_path / "out.jsonl")[0]["content"] == "Four."


def test_a_recorded_answer_after_a_prompt_that_opens_the_reasoning_round_trips():
    """answers: dataset with a template shaped like Kimi-K2.5's: the generation prompt ends
    with <think>, so the answer's ids begin with the </think> the template renders before the
    content; the content is the answer without it, and the sample passes the template check
    (thinking on, off, and cut at max_tokens)."""
    from eaglet.data.template_check import check_record
    from eaglet.stages.generate.rendering import dataset_record
    from tests.test_template_check import make_kimi_tokenizer

    tokenizer = make_kimi_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = {**prompts(1)[0], "answer": "It is four."}
    for kwargs, max_tokens, emitted, content in [
        (None, 50, "</think>It is four.<|im_end|>", "It is four."),
        ({"thinking": False}, 50, "It is four.<|im_end|>", "It is four."),
        (None, 5, "</think>It i", "It i"),
    ]:
        gen = {"chat_template_kwargs": kwargs, "system_prompt": None, "max_tokens": max_tokens}
        record = dataset_record(prompt, tokenizer, gen, {end})
        assert tokenizer.decode(record["completion_token_ids"]) == emitted
        assert record["content"] == content and record["reasoning"] is None
        result = check_record(tokenizer, record)
        assert result.ok and not result.retokenized, result.reason
