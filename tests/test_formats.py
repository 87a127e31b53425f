"""Replay input formats: each format read from a file written here, detection, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specproxy.proxy.replay.formats import FORMATS, FormatError, detect_format, read_items


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_capture_file(tmp_path: Path) -> None:
    p = write_jsonl(
        tmp_path / "capture.jsonl",
        [
            {
                "request_id": "r1",
                "arrival_unix_s": 1700000000.5,
                "path": "/v1/chat/completions",
                "category": "summarization",
                "body": {
                    "model": "m",
                    "stream": True,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 32,
                    "temperature": 0.7,
                },
            },
            {
                "request_id": "r2",
                "arrival_unix_s": 1700000002.0,
                "path": "/v1/completions",
                "headers": {"X-Specproxy-Category": "code_edit"},
                "body": {"prompt": "def f():", "max_tokens": 8},
            },
        ],
    )
    got = read_items(p)
    assert got.format == "capture"
    a, b = got.items
    assert (a.item_id, a.endpoint, a.category) == ("r1", "chat", "summarization")
    # model and stream are replay's to decide; everything else is kept as recorded
    assert a.body == {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32, "temperature": 0.7}
    assert (b.endpoint, b.category) == ("completions", "code_edit")
    assert a.arrival_s == 0.0 and b.arrival_s == pytest.approx(1.5)
    assert a.where == f"{p}:1"


def test_openai_batch(tmp_path: Path) -> None:
    p = write_jsonl(
        tmp_path / "batch.jsonl",
        [
            {
                "custom_id": "request-1",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "gpt-4o-mini",
                    "messages": [{"role": "user", "content": "Hello"}],
                    "max_tokens": 100,
                },
            },
            {"custom_id": "request-2", "body": {"model": "x", "prompt": "Once upon", "max_tokens": 5}},
        ],
    )
    got = read_items(p)
    assert got.format == "openai-batch"
    assert [(i.item_id, i.endpoint) for i in got.items] == [
        ("request-1", "chat"),
        ("request-2", "completions"),
    ]
    assert "model" not in got.items[0].body and got.items[0].body["max_tokens"] == 100


def test_vllm_custom(tmp_path: Path) -> None:
    p = write_jsonl(
        tmp_path / "custom.jsonl",
        [{"prompt": "What is 2+2?", "output_tokens": 12}, {"prompt": "Tell me a story"}],
    )
    got = read_items(p)
    assert got.format == "vllm-custom"
    assert got.items[0].body == {"messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 12}
    assert "max_tokens" not in got.items[1].body


def test_spec_bench(tmp_path: Path) -> None:
    p = write_jsonl(
        tmp_path / "question.jsonl",
        [
            {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorten it."]},
            {"question_id": 161, "category": "summarization", "turns": ["Summarize: the cat sat."]},
        ],
    )
    got = read_items(p)
    assert got.format == "spec-bench"
    assert [(i.item_id, i.category) for i in got.items] == [
        ("81", "writing"),
        ("81-t2", "writing"),
        ("161", "summarization"),
    ]
    assert got.items[1].body["messages"] == [{"role": "user", "content": "Now shorten it."}]


def test_sharegpt_array_and_line_numbers(tmp_path: Path) -> None:
    data = [
        {
            "id": "a",
            "conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "x" * 400}],
        },
        {
            "id": "b",
            "conversations": [
                {"from": "system", "value": "be nice"},
                {"from": "human", "value": "Question?"},
            ],
        },
        {"id": "c", "conversations": [{"from": "robot", "value": "??"}]},
    ]
    p = tmp_path / "sharegpt.json"
    p.write_text(json.dumps(data, indent=2), encoding="utf-8")
    with pytest.raises(FormatError) as err:
        read_items(p)
    # the third element starts on the line json.dumps(indent=2) put it on
    line = next(i for i, text in enumerate(p.read_text().splitlines(), 1) if '"c"' in text) - 1
    assert str(err.value).startswith(f"{p}:{line}: conversations[0].from: unknown speaker")
    got = read_items(p, on_error="skip")
    assert got.format == "sharegpt" and got.skipped == 1
    a, b = got.items
    assert a.body == {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 100}
    assert b.body["messages"][0]["role"] == "system" and "max_tokens" not in b.body


def test_mooncake_shared_prefix(tmp_path: Path) -> None:
    p = write_jsonl(
        tmp_path / "mooncake.jsonl",
        [
            {"timestamp": 27482, "input_length": 1000, "output_length": 40, "hash_ids": [46, 47]},
            {"timestamp": 30535, "input_length": 700, "output_length": 12, "hash_ids": [46, 48]},
            {"timestamp": 31000, "input_length": 600, "output_length": 5, "hash_ids": [99, 100]},
        ],
    )
    got = read_items(p)
    assert got.format == "mooncake"
    a, b, c = (i.body["prompt"].split(" ") for i in got.items)
    assert (len(a), len(b), len(c)) == (1000, 700, 600)
    assert a[:512] == b[:512]  # block 46 shared
    assert a[512:600] != b[512:600] and a[:512] != c[:512]
    assert [i.body["max_tokens"] for i in got.items] == [40, 12, 5]
    assert [i.arrival_s for i in got.items] == pytest.approx([0.0, 3.053, 3.518])
    assert read_items(p).items[0].body == got.items[0].body  # deterministic


def test_azure_csv(tmp_path: Path) -> None:
    p = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n",
        encoding="utf-8",
    )
    got = read_items(p)
    assert got.format == "azure"
    assert [len(i.body["prompt"].split(" ")) for i in got.items] == [374, 396]
    assert [i.body["max_tokens"] for i in got.items] == [44, 109]
    assert got.items[1].arrival_s == pytest.approx(4.314579, abs=1e-5)


def test_burstgpt_csv(tmp_path: Path) -> None:
    p = tmp_path / "BurstGPT_1.csv"
    p.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "45,GPT-4,1087,0,1087,Conversation log\n"
        "47,ChatGPT,abc,3,3,Conversation log\n",
        encoding="utf-8",
    )
    with pytest.raises(FormatError, match=rf"^{p}:4: request tokens: expected a number, got 'abc'"):
        read_items(p)
    got = read_items(p, on_error="skip")
    assert got.format == "burstgpt" and got.skipped == 1
    assert [i.arrival_s for i in got.items] == [0.0, 40.0]
    assert [i.body["max_tokens"] for i in got.items] == [18, 1]  # a failed request still prefilled


def test_bad_json_line_names_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "custom.jsonl"
    p.write_text('{"prompt": "ok"}\n\n{"prompt": "broken\n{"prompt": ""}\n', encoding="utf-8")
    with pytest.raises(FormatError, match=rf"^{p}:3: not valid JSON"):
        read_items(p)
    got = read_items(p, on_error="skip")
    assert len(got.items) == 1 and got.skipped == 2
    assert got.first_skip is not None and got.first_skip.startswith(f"{p}:3:")


def test_limit(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "c.jsonl", [{"prompt": f"q{i}"} for i in range(10)])
    assert len(read_items(p, limit=3).items) == 3


@pytest.mark.parametrize(
    "content, why",
    [
        ("", "the file is empty"),
        ("   \n\n", "the file is empty"),
        ("hello,world\n1,2\n", "unrecognised first line"),
        ('{"foo": 1}\n', "unrecognised record keys"),
    ],
)
def test_empty_or_unknown_names_the_formats(tmp_path: Path, content: str, why: str) -> None:
    p = tmp_path / "log.txt"
    p.write_text(content, encoding="utf-8")
    with pytest.raises(FormatError) as err:
        read_items(p)
    assert why in str(err.value)
    assert all(name in str(err.value) for name in FORMATS)


def test_named_format_that_does_not_fit(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "x"}])
    with pytest.raises(FormatError, match=":1: turns: expected a non-empty list"):
        read_items(p, "spec-bench")
    with pytest.raises(FormatError, match="unknown format 'parquet'"):
        read_items(p, "parquet")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="no such file"):
        read_items(tmp_path / "nope.jsonl")


def test_detect_sharegpt_jsonl(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "s.jsonl", [{"conversations": [{"from": "human", "value": "hey"}]}])
    assert detect_format(p) == "sharegpt"
    assert read_items(p).items[0].body["messages"] == [{"role": "user", "content": "hey"}]
