"""What a broken or hostile server's answer may do to the canary: nothing but fail its own request.

An outside probe's servers took the canary (and so the operator, which runs the suite in its own
process) to 3 GB with a 1 MB gzip body or a stream of empty frames, and crashed it with a traceback
(exit 1, the "fail" code) with invalid UTF-8, 200,000 levels of JSON nesting or a 5,000-digit
integer. A valid stream whose event spans two `data:` lines was called malformed. Each server here
is a real aiohttp server on loopback; the client is the suite's own.
"""

from __future__ import annotations

import asyncio
import json
import tracemalloc
import zlib

import aiohttp
import pytest
from aiohttp import web
from loopback import Handler, serving

from kvguard.cli import main as cli_main
from kvguard.operator.canary import client as canary_client
from kvguard.operator.canary.client import EngineClient, get_text


def answering(body: bytes, content_type: str = "application/json") -> Handler:
    async def handler(_request: web.Request) -> web.Response:
        return web.Response(body=body, content_type=content_type)

    return handler


async def gzip_bomb(request: web.Request) -> web.StreamResponse:
    """128 MiB of JSON whitespace as ~130 KB of gzip, one repeated deflate block at a time."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = deflate.compress(b" " * (1 << 20)) + deflate.flush(zlib.Z_SYNC_FLUSH)
    head, block = block[:10], block[10:]  # the gzip header once, then a block that only says "1 MiB of spaces"
    response = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    await response.prepare(request)
    await response.write(head + block)
    for _ in range(127):
        await response.write(block)
    return response


@pytest.fixture
def small_bound(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(canary_client, "MAX_RESPONSE_BYTES", 1 << 20)
    return 1 << 20


async def test_a_body_over_the_bound_is_that_requests_error_and_is_not_read_further(small_bound: int) -> None:
    async with serving(gzip_bomb) as url, aiohttp.ClientSession() as session:
        tracemalloc.start()
        try:
            models, error, answered = await EngineClient(session, url).list_models()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert models is None and answered and error == f"GET /v1/models: the answer is over {small_bound:,} bytes: read that far, then stopped"
    assert peak < 16 * small_bound, peak  # the whole body inflated was 128 MiB


async def test_a_stream_over_the_bound_ends_in_an_error(small_bound: int) -> None:
    async def empty_frames(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(20):  # ~2.6 MB of empty frames in 40,000 lines
            await response.write((b"data:" + b" " * 120 + b"\n\n") * 1024)
        return response

    async with serving(empty_frames) as url, aiohttp.ClientSession() as session:
        answer = await EngineClient(session, url, model="m").complete("p", stream=True)
    assert answer.error == f"the stream is over {small_bound:,} bytes: read that far, then stopped"
    assert len(answer.body) <= small_bound  # what was read, no more: the leak search reads all of it


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b'{"data": [{"id": "m\xff\xfe"}]}', "the answer is not UTF-8 (byte 19"),
        (b"[" * 200_000 + b"]" * 200_000, "a JSON body Python will not hold (RecursionError"),
        (b'{"data": [], "n": ' + b"9" * 5000 + b"}", "a JSON body Python will not hold (ValueError"),
    ],
    ids=["invalid utf-8", "deep nesting", "5000-digit integer"],
)
async def test_an_unreadable_body_is_an_error_not_an_exception(body: bytes, says: str) -> None:
    async with serving(answering(body)) as url, aiohttp.ClientSession() as session:
        client = EngineClient(session, url, model="m")
        models, error, _ = await client.list_models()
        answer = await client.complete("p")
        status, _, fetch_error = await get_text(session, f"{url}/metrics", 10)
    assert models is None and error is not None and says in error
    assert answer.error is not None and says in answer.error
    assert (status, fetch_error is not None) == ((None, True) if "UTF-8" in says else (200, False))


@pytest.mark.parametrize("body", [b'{"data": [{"id": "m\xff"}]}', b"[" * 200_000])
def test_the_cli_gives_a_verdict_line_not_a_traceback(body: bytes, capsys: pytest.CaptureFixture[str]) -> None:
    import threading

    started, stop = threading.Event(), threading.Event()
    found: list[str] = []

    def serve() -> None:
        async def main() -> None:
            async with serving(answering(body)) as url:
                found.append(url)
                started.set()
                await asyncio.to_thread(stop.wait)  # serving until the test is done with it

        asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(30)
    try:
        code = cli_main(["canary", "--url", found[0]])
    finally:
        stop.set()
        thread.join(30)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "cannot run" in err.lower(), err


async def test_an_event_whose_data_spans_lines_is_one_frame() -> None:
    """The SSE standard joins an event's `data:` lines with a newline, as the official OpenAI
    clients read them; JSON allows the newline between tokens."""
    chunk = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "split", "finish_reason": None}]}
    last = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": " event", "finish_reason": "length"}]}

    async def split_events(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in (chunk, last):
            first, rest = json.dumps(event).split(", ", 1)
            await response.write(f"data: {first},\ndata: {rest}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async with serving(split_events) as url, aiohttp.ClientSession() as session:
        answer = await EngineClient(session, url, model="m").complete("p", stream=True, max_tokens=2)
    assert (answer.error, answer.text, answer.frames_seen, answer.saw_done) == (None, "split event", 2, True)


async def test_a_line_of_megabytes_is_read_whole_and_judged_as_a_frame() -> None:
    """Lines have no bound of their own but the stream's (MAX_RESPONSE_BYTES): a 4 MiB line is read
    in many chunks, once, and is that frame's error (not JSON), not the reader's."""

    async def long_line(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: " + b"x" * (4 << 20) + b"\n\n")
        return response

    async with serving(long_line) as url, aiohttp.ClientSession() as session:
        answer = await EngineClient(session, url, model="m").complete("p", stream=True)
    assert answer.error is not None and "JSON" in answer.error and answer.frames_seen == 1, answer.error


@pytest.mark.parametrize("line_end", [b"\r", b"\r\n"], ids=["bare-CR", "CRLF"])
async def test_events_ended_by_cr_or_crlf_read_as_the_official_client_reads_them(line_end: bytes) -> None:
    """The SSE standard ends a line with CR, LF or CRLF, and the official OpenAI client splits at
    each: a server ending its events with bare CRs was one endless line to the canary (a stream
    "cut short"). Written a byte at a time (the client may read several at once: `test_sse_lines`
    splits a CRLF at every point)."""
    frames = [{"choices": [{"index": 0, "text": t, "finish_reason": f}]} for t, f in (("one ", None), ("two", "length"))]
    body = b"".join(b"data: " + json.dumps(f).encode() + line_end * 2 for f in frames) + b"data: [DONE]" + line_end * 2

    async def cr_events(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(len(body)):
            await response.write(body[i : i + 1])
        return response

    async with serving(cr_events) as url, aiohttp.ClientSession() as session:
        answer = await EngineClient(session, url, model="m").complete("p", stream=True, max_tokens=2)
    assert (answer.error, answer.text, answer.frames_seen, answer.saw_done) == (None, "one two", 2, True)
    assert answer.body == body.decode()


async def test_a_stream_is_kept_whole_for_the_leak_search_and_must_be_utf8() -> None:
    """The leak search reads every line of a stream (`Heard.raw`): kept only up to 4,000
    characters, a nonce in frame 70's reasoning went unseen (review). A stream that is not UTF-8 is
    an error, as a body is."""
    frames = [{"choices": [{"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}]} for i in range(80)]
    frames[70]["choices"][0]["delta"]["reasoning_content"] = "0123456789abcdef"
    frames[-1]["choices"][0]["finish_reason"] = "length"

    async def long_stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for frame in frames:
            await response.write(f"data: {json.dumps(frame)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n" if request.path.endswith("chat/completions") else b"data: \xff\n\n")
        return response

    async with serving(long_stream) as url, aiohttp.ClientSession() as session:
        client = EngineClient(session, url, model="m")
        chat = await client.complete("p", api="chat", stream=True, max_tokens=80)
        broken = await client.complete("p", stream=True, max_tokens=80)
    assert chat.error is None and "0123456789abcdef" in chat.body and len(chat.body) > 4000
    assert broken.error is not None and broken.error.startswith("the stream is not UTF-8")


async def newlines_written(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for _ in range(64):
        await response.write(b"\n" * 65536)
    return response


NEWLINES_DEFLATED = zlib.compress(b"\n" * (8 << 20), 9)


async def newlines_deflated(request: web.Request) -> web.Response:
    return web.Response(body=NEWLINES_DEFLATED, headers={"Content-Type": "text/event-stream", "Content-Encoding": "deflate"})


@pytest.mark.parametrize("handler", [newlines_written, newlines_deflated], ids=["written", "deflated"])
async def test_a_stream_of_empty_lines_is_bounded_and_lets_the_loop_run(handler: Handler) -> None:
    """16 MiB of newlines (2 MB of gzip) held the event loop for 30 s past the request's timeout:
    the reader did not yield while it had data buffered (outside probe). Compressed, aiohttp hands
    the inflated body over in reads of up to 786 KiB, each split a line at a time between the
    bound's checks and the loop's turns (review)."""
    ticks = 0
    loop = asyncio.get_running_loop()

    def tick() -> None:  # one per turn of the loop: another task's share while the stream is read
        nonlocal ticks, pending
        ticks += 1
        pending = loop.call_soon(tick)

    async with serving(handler) as url, aiohttp.ClientSession() as session:
        pending = loop.call_soon(tick)
        answer = await EngineClient(session, url, model="m").complete("p", stream=True)
        pending.cancel()
    assert answer.error == f"the stream is over {canary_client.MAX_STREAM_LINES:,} lines: read that far, then stopped"
    assert ticks >= canary_client.MAX_STREAM_LINES // 256 // 2  # the loop ran other tasks while it read


@pytest.mark.parametrize("tail", [b"\xff", "\u00e9".encode()[:1]], ids=["bad-byte", "half-a-character"])
async def test_bytes_received_after_the_reader_stopped_are_not_the_answers_error(tail: bytes) -> None:
    """A reader that stops at [DONE] (or at a planned disconnect) may have received, in the same
    read, bytes it never reads as lines: a healthy server's next chunk cut inside a character, or
    junk after [DONE]. Decoding them strictly raised out of `complete` (review); they are kept as
    U+FFFD in the body, and the answer is judged on what was read."""
    frame = {"choices": [{"index": 0, "text": "done", "finish_reason": "length"}]}

    async def trailing(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(f"data: {json.dumps(frame)}\n\ndata: [DONE]\n\n".encode() + tail)
        return response

    async with serving(trailing) as url, aiohttp.ClientSession() as session:
        answer = await EngineClient(session, url, model="m").complete("p", stream=True, max_tokens=1)
    assert (answer.error, answer.text, answer.saw_done) == (None, "done", True)
    assert answer.body.endswith("data: [DONE]\n\n\ufffd")


async def test_a_last_event_without_its_blank_line_is_dropped_as_the_official_client_drops_it() -> None:
    """Counted, it passed a stream whose last token (and finish) the openai client never shows."""
    first = {"choices": [{"index": 0, "text": "shown", "finish_reason": None}]}
    last = {"choices": [{"index": 0, "text": " unseen", "finish_reason": "length"}]}

    async def unterminated(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(f"data: {json.dumps(first)}\n\ndata: {json.dumps(last)}\n".encode())
        return response

    async with serving(unterminated) as url, aiohttp.ClientSession() as session:
        answer = await EngineClient(session, url, model="m").complete("p", stream=True, max_tokens=2)
    assert answer.text == "shown" and answer.error is not None and answer.error.startswith("stream cut short")


@pytest.mark.parametrize("value", ["NaN", "+Inf"])
def test_a_metrics_page_with_nan_or_infinity_is_no_reading_not_a_crash(value: str) -> None:
    from kvguard.operator.canary.metrics import snapshot_from_text

    text = (f"kvguard_kv_pool_capacity_tokens {value}\nkvguard_context_length_tokens {value}\n"
            f'vllm:cache_config_info{{kv_cache_size_tokens="{value.lower().lstrip("+")}"}} 1\n')  # fmt: skip
    snap = snapshot_from_text("http://w/metrics", text)
    assert (snap.engine, snap.pools, snap.context_length) == ("kvguard", [], None)
    counter = snapshot_from_text("http://w/metrics", f"kvguard_tag_violations_total {value}\n").counter("kvguard_tag_violations_total")
    assert counter is not None and (counter == float("inf") if value == "+Inf" else counter == 0)  # (review: +Inf read as 0)


async def test_a_worker_whose_pool_size_is_not_a_number_fails_capacity() -> None:
    """Not a router without a pool: a worker that reports one no one can read (outside probe: NaN
    passed beside a healthy worker as "router?")."""
    from kvguard.operator.canary import CanarySpec, ProbeName, ProbeStatus, run_suite

    def metrics(pool: str) -> Handler:
        text = f"kvguard_kv_pool_capacity_tokens {pool}\nkvguard_context_length_tokens 1024\n"
        return answering(text.encode(), "text/plain")

    models = answering(json.dumps({"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 1024}]}).encode())
    async with serving(models) as url, serving(metrics("8192")) as good, serving(metrics("NaN")) as nan:
        report = await run_suite(url, CanarySpec().only([ProbeName.CAPACITY]), metrics_urls=[f"{good}/metrics", f"{nan}/metrics"])
    capacity = report.probe(ProbeName.CAPACITY)
    assert capacity is not None and capacity.status == ProbeStatus.FAIL, capacity
    assert "reports a KV pool size that is not a number (kvguard_kv_pool_capacity_tokens = nan)" in capacity.reason
