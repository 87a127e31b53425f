"""The upstream-call library shared by proxy and replay: SSE parser, completion tap, call_arm, identity."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import orjson
import pytest

from specproxy.config import Arm
from specproxy.proxy.identity import compare, first_difference, is_comparable
from specproxy.proxy.upstream.acceptance import shape_estimate
from specproxy.proxy.upstream.calls import (
    UpstreamState,
    UpstreamTimeout,
    call_arm,
    new_record,
    upstream_request_id,
)
from specproxy.proxy.upstream.sse import (
    MAX_EVENT_BYTES,
    CompletionTap,
    EventTooLarge,
    MalformedEvent,
    SSEParser,
)
from specproxy.proxy.upstream.wire import UpstreamClient
from tests.backends import BackendConfig, running_backend, token_ids_for, token_text
from tests.support import free_port, wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "héllo"}], "temperature": 0, "max_tokens": 9}


def test_sse_parser_survives_any_split_point() -> None:
    stream = (
        b": keep-alive comment\n\n"
        + b'data: {"a": "\xc3\xa9\xe2\x82\xac"}\n\n'
        + b"event: x\r\ndata: line1\r\ndata: line2\r\n\r\n"
        + b"data: [DONE]\n\n"
    )
    for cut in range(1, len(stream)):
        p = SSEParser()
        events = p.feed(stream[:cut]) + p.feed(stream[cut:]) + p.flush()
        datas = [e.data for e in events]
        assert datas == [None, '{"a": "é€"}'.encode(), b"line1\nline2", b"[DONE]"], cut


def test_sse_parser_flushes_truncated_event() -> None:
    p = SSEParser()
    assert p.feed(b"data: 1\n\ndata: 2")[0].data == b"1"
    assert p.pending == 7
    assert [e.data for e in p.flush()] == [b"2"]


def test_sse_parser_is_linear_in_an_event_held_across_many_reads() -> None:
    # 12 MiB in 1 KiB reads: a parser that rescans or copies what it holds does ~70 GB of work here
    # and runs into the test's timeout; one that scans each read once takes a fraction of a second.
    p = SSEParser()
    assert p.feed(b"data: " + b"x" * 1018) == []
    for _ in range(12 * 1024 - 1):
        assert p.feed(b"x" * 1024) == []
    assert p.pending == 12 * 1024 * 1024
    events = p.feed(b"\r\n\r\ndata: [DONE]\n\n")
    assert [len(e.data or b"") for e in events] == [12 * 1024 * 1024 - 6, 6]


def test_sse_parser_cuts_an_event_over_its_cap() -> None:
    p = SSEParser()
    assert [e.data for e in p.feed(b"data: 1\n\n")] == [b"1"]
    p.feed(b"data: ")
    with pytest.raises(EventTooLarge, match=f"event over {MAX_EVENT_BYTES} bytes"):
        for _ in range(MAX_EVENT_BYTES // 65536 + 1):
            p.feed(b"y" * 65536)
    assert p.pending == 0
    assert isinstance(EventTooLarge("x"), MalformedEvent)  # an upstream error, like any bad event


def _chunk(text: str, **extra: Any) -> bytes:
    return orjson.dumps({"choices": [{"index": 0, "delta": {"content": text}, **extra}]})


def test_tap_counts_tokens_from_token_ids_then_usage_then_chunks() -> None:
    tap = CompletionTap("chat")
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    tap.feed_data(orjson.dumps(role), 1.0)
    tap.feed_data(_chunk("ab", token_ids=[1, 2, 3]), 2.0)
    tap.feed_data(_chunk("c", token_ids=[4], finish_reason="stop"), 3.0)
    tap.feed_data(b"[DONE]", 3.5)
    assert (tap.t_first, tap.t_last, tap.tokens_per_chunk, tap.completion_tokens) == (2.0, 3.0, [3, 1], 4)
    assert tap.text() == "abc" and tap.token_ids == [1, 2, 3, 4] and tap.finish_reason == "stop" and tap.done

    usage_tap = CompletionTap("completions")
    for i, cum in enumerate((2, 5, 6)):
        usage_tap.feed_data(
            orjson.dumps({"choices": [{"index": 0, "text": "x"}], "usage": {"completion_tokens": cum}}),
            float(i),
        )
    final = {"choices": [], "usage": {"completion_tokens": 6, "prompt_tokens": 3}}
    usage_tap.feed_data(orjson.dumps(final), 9.0)
    assert usage_tap.tokens_per_chunk == [2, 3, 1] and usage_tap.completion_tokens == 6
    assert usage_tap.count_source == "continuous_usage" and usage_tap.prompt_tokens == 3
    shape = shape_estimate(usage_tap, 4)
    assert shape is not None and (shape.num_drafts, shape.accepted_tokens, shape.draft_tokens) == (2, 2, 8)

    plain = CompletionTap("chat")
    for i in range(3):
        plain.feed_data(_chunk("long text of many words"), float(i))
    assert plain.completion_tokens == 3 and shape_estimate(plain, 4) is None


def test_identity_tokens_text_and_margin() -> None:
    a, b = CompletionTap("chat"), CompletionTap("chat")
    for tap, ids in ((a, [1, 2, 3]), (b, [1, 2, 9])):
        lp = {
            "content": [
                {"token": f"t{i}", "logprob": 0.0, "top_logprobs": [{"logprob": 0.0}, {"logprob": -0.25}]}
                for i in ids
            ]
        }
        tap.feed_data(_chunk("x", token_ids=ids, logprobs=lp), 1.0)
    assert compare(a, b) == (False, 2, 0.25)
    assert compare(a, a) == (True, None, None)
    c, d = CompletionTap("chat"), CompletionTap("chat")
    c.feed_data(_chunk("hello world"), 1.0)
    d.feed_data(_chunk("hello there"), 1.0)
    assert compare(c, d) == (False, 6, None)
    assert first_difference("ab", "abc") == 2
    assert is_comparable({"temperature": 0}) and not is_comparable({"temperature": 0.7})
    assert not is_comparable({}) and not is_comparable({"temperature": 0, "n": 2})


def _arm(url: str, **kw: Any) -> Arm:
    return Arm(name=kw.pop("name", "a"), url=url, **kw)


class _Collect:
    def __init__(self) -> None:
        self.status: int | None = None
        self.data = bytearray()

    async def start(self, status: int, content_type: str, headers: Sequence[tuple[str, str]] = ()) -> None:
        self.status = status

    def send(self, data: bytes) -> bool:
        self.data += data
        return False

    async def drain(self) -> None:
        pass


async def test_call_arm_stream_fills_span_and_relays_what_client_asked() -> None:
    cfg = BackendConfig(tokens_per_chunk=3, spec_metrics=False)
    async with running_backend(cfg) as b, UpstreamClient() as s:
        arm = _arm(b.url, return_token_ids=True, speculative={"method": "ngram", "num_speculative_tokens": 2})
        body = {**CHAT, "stream": True}
        rec = new_record("run", "r1", arm, body, endpoint="chat", routed_as="primary", category="code")
        relay = _Collect()
        res = await call_arm(s, arm, body, endpoint="chat", record=rec, relay=relay)
        assert rec.status == "ok" and relay.status == 200
        # The backend was asked for the extensions...
        sent = b.stats.bodies[-1]
        assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        assert sent["return_token_ids"] is True
        assert b.stats.headers[-1]["X-Specproxy-Category"] == "code"
        assert b.stats.headers[-1]["X-Request-Id"] == upstream_request_id("r1")
        # ...and the client got none of them.
        assert b"usage" not in relay.data and b"token_ids" not in relay.data
        assert relay.data.endswith(b"data: [DONE]\n\n")
        ids = token_ids_for(orjson.dumps(CHAT["messages"], option=orjson.OPT_SORT_KEYS), 9)
        assert res.token_ids == ids and res.text == "".join(token_text(t) for t in ids)
        assert rec.completion_tokens == 9 and rec.chunks == 4 and rec.finish_reason == "length"
        # n-gram drafts only where the text matched: an estimate from the shape, flagged as such.
        assert rec.spec_source == "stream_shape_unreliable"
        assert rec.num_drafts == 3 and rec.accepted_tokens == 5
        assert rec.draft_tokens == 6 and rec.acceptance_length == pytest.approx(1 + 5 / 3)
        assert rec.ttft_s is not None and rec.e2e_s is not None and rec.e2e_s >= rec.ttft_s
        assert rec.output_text is None and rec.output_sha256 and rec.prompt_sha256


async def test_call_arm_passes_usage_through_when_client_asked_and_reads_vllm_metrics() -> None:
    cfg = BackendConfig(tokens_per_chunk=2, spec_metrics=True)
    async with running_backend(cfg) as b, UpstreamClient() as s:
        arm = _arm(b.url, speculative={"method": "eagle3", "model": "x", "num_speculative_tokens": 1})
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        rec = new_record("run", "r2", arm, body, endpoint="chat", routed_as="primary")
        relay = _Collect()
        await call_arm(s, arm, body, endpoint="chat", record=rec, relay=relay, capture_output=True)
        events = [e.data for e in SSEParser().feed(bytes(relay.data))]
        chunks = [orjson.loads(d) for d in events if d is not None and d != b"[DONE]"]
        assert all("usage" not in c for c in chunks if c["choices"])  # not continuous: not asked
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 9
        assert rec.spec_source == "vllm_request_metrics" and rec.num_drafts == 4 and rec.output_text


async def test_call_arm_non_vllm_backend_rejecting_extensions_is_retried_and_remembered() -> None:
    async with running_backend(BackendConfig(reject_extensions=True, vllm=False)) as b, UpstreamClient() as s:
        arm, state = _arm(b.url, return_token_ids=True), UpstreamState()
        for i in range(2):
            body = {**CHAT, "stream": True}
            rec = new_record("run", f"r{i}", arm, body, endpoint="chat", routed_as="primary")
            await call_arm(s, arm, body, endpoint="chat", record=rec, state=state)
            assert rec.status == "ok" and rec.spec_source == "none"
            # No usage and no tokenizer: the text estimate, marked as one.
            assert rec.tokens_source == "text_estimate" and rec.completion_tokens
        # The extensions rejected, then the standard include_usage; both remembered.
        assert b.stats.requests == 4
        assert b.url in state.rejects_extensions and b.url in state.rejects_stream_options


async def test_a_clients_own_bad_stream_options_do_not_switch_extensions_off() -> None:
    async with running_backend(BackendConfig()) as b, UpstreamClient() as s:
        arm, state = (
            _arm(b.url, speculative={"method": "ngram", "num_speculative_tokens": 2}),
            UpstreamState(),
        )
        bad = {**CHAT, "stream": True, "stream_options": {"bogus": True}}
        rec = new_record("run", "bad", arm, bad, endpoint="chat", routed_as="primary")
        await call_arm(s, arm, bad, endpoint="chat", record=rec, state=state)
        assert (rec.status, rec.http_status) == ("http_error", 400)
        # Tried again without the extensions, then without stream_options: still refused each time.
        assert b.stats.requests == 3
        assert not state.rejects_extensions
        good = {**CHAT, "stream": True}
        rec = new_record("run", "good", arm, good, endpoint="chat", routed_as="primary")
        await call_arm(s, arm, good, endpoint="chat", record=rec, state=state)
        assert b.stats.bodies[-1]["stream_options"]["continuous_usage_stats"] is True
        assert rec.status == "ok" and (rec.spec_source or "").startswith("stream_shape")


async def test_a_plain_client_error_is_not_retried_and_a_refusal_is_probed_again_later() -> None:
    async with running_backend(BackendConfig(reject_extensions=True)) as b, UpstreamClient() as s:
        arm, state = _arm(b.url), UpstreamState(reprobe_after_s=0.0)
        plain = {**CHAT, "stream_options": {"include_usage": True}}  # not streaming: the proxy adds nothing
        rec = new_record("run", "p", arm, plain, endpoint="chat", routed_as="primary")
        await call_arm(s, arm, plain, endpoint="chat", record=rec, state=state)
        assert rec.http_status == 400 and b.stats.requests == 1
        for i in range(2):
            body = {**CHAT, "stream": True}
            rec = new_record("run", f"r{i}", arm, body, endpoint="chat", routed_as="primary")
            await call_arm(s, arm, body, endpoint="chat", record=rec, state=state)
            assert rec.status == "ok"
        # Re-probed at once (reprobe_after_s=0): each call tries the extensions, then stream_options,
        # again before the plain request that this backend takes.
        assert b.stats.requests == 1 + 2 * 3


async def test_call_arm_non_streaming_passes_body_through() -> None:
    async with running_backend(BackendConfig()) as b, UpstreamClient() as s:
        arm = _arm(b.url)
        rec = new_record("run", "r", arm, CHAT, endpoint="chat", routed_as="primary")
        relay = _Collect()
        res = await call_arm(s, arm, CHAT, endpoint="chat", record=rec, relay=relay)
        out = orjson.loads(relay.data)
        assert out["choices"][0]["message"]["content"] == res.text and rec.completion_tokens == 9
        assert rec.ttft_s is None and rec.stream is False and "stream_options" not in b.stats.bodies[-1]


@pytest.mark.parametrize(
    ("fail", "status", "http_status"),
    [
        ("http500", "http_error", 500),
        ("http429", "http_error", 429),
        ("reset", "upstream_error", 200),
        ("garbage", "upstream_error", 200),
    ],
)
async def test_call_arm_upstream_failures_become_statuses(fail: str, status: str, http_status: int) -> None:
    async with running_backend(BackendConfig(fail=fail)) as b, UpstreamClient() as s:
        arm = _arm(b.url)
        body = {**CHAT, "stream": fail == "reset"}
        rec = new_record("run", "r", arm, body, endpoint="chat", routed_as="primary")
        await call_arm(s, arm, body, endpoint="chat", record=rec)
        assert (rec.status, rec.http_status) == (status, http_status)
        assert rec.error


async def test_call_arm_refused_and_timeout() -> None:
    async with UpstreamClient() as s:
        arm = _arm(f"http://127.0.0.1:{free_port()}")
        rec = new_record("run", "r", arm, CHAT, endpoint="chat", routed_as="primary")
        await call_arm(s, arm, CHAT, endpoint="chat", record=rec)
        assert rec.status == "upstream_error" and rec.http_status is None
    async with running_backend(BackendConfig(fail="hang")) as b, UpstreamClient() as s:
        arm = _arm(b.url)
        rec = new_record("run", "r", arm, CHAT, endpoint="chat", routed_as="primary")
        await call_arm(s, arm, CHAT, endpoint="chat", record=rec, timeout=UpstreamTimeout(total=0.3))
        assert rec.status == "timeout" and (rec.e2e_s or 0) >= 0.25  # at its timeout, not at once


async def test_read_timeout_ends_a_stream_that_stalls_but_not_one_that_keeps_sending() -> None:
    # The read timeout is a watchdog (one timer per period, not one per read): a stream silent
    # for longer than it times out; a stream whose whole length is many read timeouts but whose gaps are
    # shorter does not. Gaps 10x shorter than the timeout: a busy machine does not stretch them that far.
    timeout = UpstreamTimeout(read=1.0)
    async with running_backend(BackendConfig(fail="stall", itl_s=0.01)) as b, UpstreamClient() as s:
        arm = _arm(b.url)
        body = {**CHAT, "stream": True}
        rec = new_record("run", "r", arm, body, endpoint="chat", routed_as="primary")
        relay = _Collect()
        await call_arm(s, arm, body, endpoint="chat", record=rec, relay=relay, timeout=timeout)
        assert rec.status == "timeout" and (rec.e2e_s or 0) >= 1.0
        assert rec.chunks == 2 and b"w" in relay.data
        # The stalled connection is closed.
        await wait_until(lambda: b.stats.cancelled == 1, "the backend to see the call cancelled")
    async with running_backend(BackendConfig(itl_s=0.1, tokens=25)) as b, UpstreamClient() as s:
        arm = _arm(b.url)
        body = {**CHAT, "stream": True, "max_tokens": 25}
        rec = new_record("run", "r", arm, body, endpoint="chat", routed_as="primary")
        await call_arm(s, arm, body, endpoint="chat", record=rec, timeout=timeout)
        # 24 gaps of 0.1 s: longer than two read timeouts in all.
        assert rec.status == "ok" and rec.completion_tokens == 25 and (rec.e2e_s or 0) > 2.3


async def test_cancelling_call_arm_aborts_the_upstream_generation() -> None:
    async with running_backend(BackendConfig(itl_s=0.05, tokens=100)) as b, UpstreamClient() as s:
        arm = _arm(b.url)
        body = {"model": "m", "prompt": "p", "stream": True, "max_tokens": 100}
        rec = new_record("run", "r", arm, body, endpoint="completions", routed_as="primary")
        task = asyncio.create_task(call_arm(s, arm, body, endpoint="completions", record=rec))
        await wait_until(lambda: b.stats.active == 1, "the backend to be generating")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert rec.status == "client_cancelled"
        await wait_until(lambda: b.stats.cancelled == 1, "the backend to see the call cancelled")
        assert b.stats.completed == 0
