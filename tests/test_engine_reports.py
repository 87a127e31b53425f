"""What each engine reports, read into one record; token counts and where they came from."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import orjson
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from specproxy.config import Arm, ConfigError, parse_experiment
from specproxy.proxy.upstream.acceptance import MergeCalibration, speculation_for
from specproxy.proxy.upstream.engines import engine_report
from specproxy.proxy.upstream.scrape import engine_load, parse_metrics, spec_decode_summary
from specproxy.proxy.upstream.sse import CompletionTap
from specproxy.proxy.upstream.tokens import (
    ChunkEvidence,
    count_completion_tokens,
    estimate_tokens,
    load_tokenizer,
)

PLAIN = Arm(name="plain", url="http://plain")
EAGLE = Arm(
    name="eagle",
    url="http://eagle",
    speculative={"method": "eagle3", "model": "d", "num_speculative_tokens": 3},
)


def _stream(endpoint: str, chunks: list[dict[str, Any]]) -> CompletionTap:
    tap = CompletionTap("completions" if endpoint == "completions" else "chat")
    for i, chunk in enumerate(chunks):
        tap.feed_data(orjson.dumps(chunk), float(i))
    tap.feed_data(b"[DONE]", float(len(chunks)))
    return tap


def _text_chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def test_llama_server_usage_next_to_choices_is_the_total_not_an_increment() -> None:
    chunks = [_text_chunk(f" w{i}") for i in range(47)]
    final = _text_chunk(" end", "length") | {
        "usage": {"completion_tokens": 48, "prompt_tokens": 5, "total_tokens": 53},
        "timings": {"predicted_n": 48, "draft_n": 20, "draft_n_accepted": 12, "predicted_ms": 100.0},
    }
    tap = _stream("completions", [*chunks, final])
    assert tap.usage_tokens == 48 and tap.completion_tokens == 48
    count = count_completion_tokens(tap, PLAIN, ChunkEvidence())
    assert (count.tokens, count.source) == (48, "usage")
    assert tap.engine_hint == "llamacpp"
    report = engine_report(tap, "llamacpp")
    assert report is not None and report.spec_source == "llamacpp_timings"
    assert (report.draft_tokens, report.accepted_tokens, report.num_drafts) == (20, 12, None)
    # 48 tokens: the first from prefill, then 35 decoding steps that accepted 12 drafts.
    assert report.acceptance_length == pytest.approx(1 + 12 / 35)


def test_an_empty_stream_that_ended_has_zero_tokens() -> None:
    tap = _stream("completions", [_text_chunk("", "stop")])
    count = count_completion_tokens(tap, PLAIN, ChunkEvidence())
    assert (count.tokens, count.source) == (0, "text_estimate")


def test_chunks_count_only_on_a_plain_arm_whose_chunks_matched_usage() -> None:
    evidence = ChunkEvidence()
    chunks = [_text_chunk(f" w{i}") for i in range(5)] + [_text_chunk("", "stop")]
    usage = {"choices": [], "usage": {"completion_tokens": 6, "prompt_tokens": 1, "total_tokens": 7}}
    # With usage: the end token is counted by the engine, not carried by a text chunk (offset 1).
    assert (
        count_completion_tokens(_stream("completions", [*chunks, usage]), PLAIN, evidence).source == "usage"
    )
    count = count_completion_tokens(_stream("completions", chunks), PLAIN, evidence)
    assert (count.tokens, count.source) == (6, "chunks")
    # The same stream from a speculating arm is never counted by chunks.
    assert count_completion_tokens(_stream("completions", chunks), EAGLE, evidence).source == "text_estimate"
    # A stream whose chunks held two tokens disproves it for good.
    merged = {"choices": [], "usage": {"completion_tokens": 12, "prompt_tokens": 1, "total_tokens": 13}}
    count_completion_tokens(_stream("completions", [*chunks, merged]), PLAIN, evidence)
    assert count_completion_tokens(_stream("completions", chunks), PLAIN, evidence).source == "text_estimate"


def _word_tokenizer(path: Path) -> Path:
    vocab = {"[UNK]": 0, "the": 1, "cache": 2, "holds": 3, "batch": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out = path / "tokenizer.json"
    tok.save(str(out))
    return out


def test_a_tokenizer_counts_when_there_is_no_usage_and_is_named_in_the_experiment(tmp_path: Path) -> None:
    path = _word_tokenizer(tmp_path)
    tap = _stream("completions", [_text_chunk(" the cache"), _text_chunk(" holds the batch", "stop")])
    count = count_completion_tokens(tap, PLAIN, ChunkEvidence(), tokenizer=load_tokenizer(str(path)))
    # Five words of text, and the end token the engine stopped on (counted by vLLM, no text of its own).
    assert (count.tokens, count.source) == (6, "tokenizer")
    cut = _stream("completions", [_text_chunk(" the cache"), _text_chunk(" holds the batch", "length")])
    assert (
        count_completion_tokens(cut, PLAIN, ChunkEvidence(), tokenizer=load_tokenizer(str(path))).tokens == 5
    )
    # llama.cpp does not count the end token (llama-cpp-python: a stopped answer's usage = its text tokens).
    tokenizer = load_tokenizer(str(path))
    llama = count_completion_tokens(tap, PLAIN, ChunkEvidence(), tokenizer=tokenizer, engine="llamacpp")
    assert (llama.tokens, llama.source) == (5, "tokenizer")
    exp_file = tmp_path / "exp.toml"
    exp_file.write_text("")
    data = {
        "experiment": {"tokenizer": "tokenizer.json"},
        "arms": [{"name": "b", "role": "baseline", "url": "http://x", "engine": "llamacpp"}],
    }
    exp = parse_experiment(data, str(exp_file))
    assert exp.baseline.tokenizer == str(path) and exp.baseline.engine_kind == "llamacpp"
    data["experiment"] = {"tokenizer": "missing.json"}
    with pytest.raises(ConfigError, match=r"experiment\.tokenizer: 'missing.json' is not a file"):
        parse_experiment(data, str(exp_file))
    data["experiment"] = {}
    data["arms"][0]["engine"] = {"kind": "tgi"}  # type: ignore[index]
    with pytest.raises(ConfigError, match=r"arms\[0\]\.engine\.kind: must be one of"):
        parse_experiment(data, str(exp_file))


def test_a_gguf_tokenizer_is_refused_up_front_without_llama_cpp_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    exp_file = tmp_path / "exp.toml"
    data = {
        "experiment": {"tokenizer": "model.gguf"},
        "arms": [{"name": "b", "role": "baseline", "url": "http://x"}],
    }
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llama_cpp" else find_spec(n, *a)
    )
    with pytest.raises(
        ConfigError, match=r"'model.gguf' is a GGUF model: reading its tokenizer needs llama-cpp"
    ):
        parse_experiment(data, str(exp_file))


def test_text_estimate_counts_word_pieces() -> None:
    assert estimate_tokens(" the cache holds the batch") == 5
    assert estimate_tokens("") == 0
    assert estimate_tokens(" internationalization") > 1


def test_sglang_and_trtllm_payloads_read_into_the_same_record() -> None:
    sglang = CompletionTap("chat")
    details = {
        "spec_verify_ct": 10,
        "spec_num_proposed_drafts": 30,
        "spec_num_correct_drafts": 18,
        "spec_accept_length": 2.8,
        "spec_correct_drafts_histogram": [2, 3, 3, 2],
    }
    body = {
        "choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "stop", "matched_stop": 2}]
    }
    sglang.feed_body(orjson.dumps(body | {"sglext": {"spec_tokens_details": details}}), 0.0)
    report = engine_report(sglang, sglang.engine_hint or "unknown")
    assert sglang.engine_hint == "sglang" and report is not None
    assert (report.num_drafts, report.draft_tokens, report.accepted_tokens) == (10, 30, 18)
    assert report.acceptance_length == 2.8 and report.histogram == (2, 3, 3, 2)

    trt = CompletionTap("chat")
    sd = {
        "num_spec_steps": 8,
        "total_draft_tokens": 24,
        "total_accepted_draft_tokens": 12,
        "acceptance_rate": 0.5,
    }
    choice = {
        "index": 0,
        "message": {"content": "x"},
        "finish_reason": "stop",
        "avg_decoded_tokens_per_iter": 2.0,
    }
    trt.feed_body(orjson.dumps({"choices": [choice | {"speculative_decoding": sd}]}), 0.0)
    report = engine_report(trt, trt.engine_hint or "unknown")
    assert (
        trt.engine_hint == "trtllm" and report is not None and report.spec_source == "trtllm_request_metrics"
    )
    assert (report.num_drafts, report.draft_tokens, report.accepted_tokens) == (8, 24, 12)
    assert report.acceptance_length == pytest.approx(2.5)


def test_vllm_per_request_timing_gives_queue_time() -> None:
    tap = CompletionTap("chat")
    metrics = {"queue_time_ms": 250.0, "time_to_first_token_ms": 300.0, "speculative_decoding": None}
    tap.feed_body(orjson.dumps({"choices": [], "metrics": metrics, "kv_transfer_params": None}), 0.0)
    report = engine_report(tap, "vllm")
    assert tap.engine_hint == "vllm" and report is not None
    assert report.queue_s == 0.25 and report.server_ttft_s == 0.3 and not report.has_speculation


def _shape_tap(sizes: list[int]) -> CompletionTap:
    tap = CompletionTap("completions")
    total = 0
    for i, n in enumerate(sizes):
        total += n
        chunk = _text_chunk("x" * n) | {"usage": {"completion_tokens": total, "prompt_tokens": 1}}
        tap.feed_data(orjson.dumps(chunk), float(i))
    tap.feed_data(b"[DONE]", 99.0)
    return tap


def _plain_stream(tokens: int, chunks: int) -> CompletionTap:
    parts = [_text_chunk(" w") for _ in range(chunks)]
    usage = {"choices": [], "usage": {"completion_tokens": tokens, "prompt_tokens": 1}}
    return _stream("completions", [*parts, usage])


def test_stream_shape_is_trusted_only_where_it_holds() -> None:
    calibration = MergeCalibration()
    # No plain stream seen yet: nothing says the server does not merge steps.
    assert speculation_for(_shape_tap([1, 4, 2, 3]), EAGLE, None, calibration)[1] == "stream_shape_unreliable"
    speculation_for(_plain_stream(10, 10), PLAIN, None, calibration)
    spec, source = speculation_for(_shape_tap([1, 4, 2, 3]), EAGLE, None, calibration)
    assert source == "stream_shape" and spec is not None
    assert (spec.num_drafts, spec.accepted_tokens, spec.draft_tokens) == (3, 6, 9)
    # A chunk larger than k + 1 tokens holds merged steps.
    assert speculation_for(_shape_tap([1, 4, 6]), EAGLE, None, calibration)[1] == "stream_shape_unreliable"
    # Plain streams merging under load: the shape no longer tells drafts from merged steps.
    for _ in range(5):
        speculation_for(_plain_stream(30, 10), PLAIN, None, calibration)
    assert speculation_for(_shape_tap([1, 4, 2, 3]), EAGLE, None, calibration)[1] == "stream_shape_unreliable"
    # An arm that speculates with nothing to go on says so; a plain arm says none.
    assert speculation_for(_stream("completions", [_text_chunk("a")]), EAGLE, None, calibration) == (
        None,
        "unknown",
    )
    assert speculation_for(_plain_stream(3, 3), PLAIN, None, calibration) == (None, "none")


LLAMACPP_METRICS = """\
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 3
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 5
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total {drafts}
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total {draft_tokens}
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total {accepted}
"""


def test_scraper_reads_llama_cpp_names() -> None:
    before = parse_metrics("a", LLAMACPP_METRICS.format(drafts=10, draft_tokens=40, accepted=20))
    after = parse_metrics("a", LLAMACPP_METRICS.format(drafts=30, draft_tokens=120, accepted=70))
    assert after.engine == "llamacpp" and engine_load(after) == (3.0, 5.0)
    summary = spec_decode_summary(before, after)
    assert (summary["num_drafts"], summary["draft_tokens"], summary["accepted_tokens"]) == (20, 80, 50)
    assert summary["mean_acceptance_length"] == pytest.approx(1 + 50 / 20)


def test_ngram_drafts_are_counted_only_where_prompt_lookup_matched() -> None:
    arm = Arm(
        name="ngram",
        url="http://ngram",
        speculative={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 2,
        },
    )
    prompt = [1, 2, 3, 4, 5, 6]
    # After the prefill token 9: "6 9" and "9 1" occur nowhere earlier (no draft, one token each);
    # "1 2" does (the prompt): 3 4 5 drafted, 2 accepted + the bonus; then "4 5": 6 . . drafted, 0 kept.
    chunks = [[9], [1], [2], [3, 4, 5], [7]]
    tap = CompletionTap("completions")
    tap.feed_data(orjson.dumps({"choices": [{"index": 0, "text": "", "prompt_token_ids": prompt}]}), 0.0)
    for i, ids in enumerate(chunks):
        tap.feed_data(orjson.dumps({"choices": [{"index": 0, "text": "x", "token_ids": ids}]}), float(i))
    tap.feed_data(b"[DONE]", 9.0)
    calibration = MergeCalibration()
    speculation_for(_plain_stream(4, 4), PLAIN, None, calibration)
    spec, source = speculation_for(tap, arm, None, calibration)
    assert source == "stream_shape" and spec is not None
    assert (spec.num_drafts, spec.draft_tokens, spec.accepted_tokens) == (2, 6, 2)
