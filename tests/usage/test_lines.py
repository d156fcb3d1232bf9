"""Tests for spendguard.usage.lines: bytes to lines across chunk boundaries, bounded."""

from __future__ import annotations

import json
import time

from spendguard.usage import Usage, UsageObserver
from spendguard.usage.lines import LineDecoder, LongLine
from tests.support import bodies
from tests.support.bodies import SSE, retained_bytes, sse

BOM = "\ufeff".encode()


def decode_all(chunks: list[bytes], max_line: int = 1024) -> list[bytes | LongLine]:
    decoder = LineDecoder(max_line, 16)
    return [line for chunk in chunks for line in decoder.decode(chunk)]


def observe(chunks: list[bytes]) -> UsageObserver:
    return bodies.observe("openai", SSE, chunks)


# --- the decoder itself ---------------------------------------------------------------------


def test_lf_crlf_and_lone_cr_all_end_lines() -> None:
    assert decode_all([b"a\nb\r\nc\rd\n"]) == [b"a", b"b", b"c", b"d"]
    assert decode_all([b"\r\r\n\n"]) == [b"", b"", b""]


def test_crlf_split_across_chunks_ends_one_line() -> None:
    assert decode_all([b"a\r", b"\nb\r", b"\n"]) == [b"a", b"b"]
    # A CR-only stream: the next chunk's first byte is no LF, so nothing is skipped.
    assert decode_all([b"a\r", b"b\r"]) == [b"a", b"b"]
    # Only one LF is skipped after a chunk-final CR: the second is an empty line.
    assert decode_all([b"a\r", b"\n\n"]) == [b"a", b""]


def test_line_split_across_chunks_is_joined() -> None:
    assert decode_all([b"da", b"ta: x", b"y\nz", b"\n"]) == [b"data: xy", b"z"]


def test_unterminated_line_is_pending_not_decoded() -> None:
    decoder = LineDecoder(1024, 16)
    assert list(decoder.decode(b"a\nbc")) == [b"a"]
    assert decoder.pending() == b"bc"
    assert decoder.pending() == b"bc"  # peeking does not consume
    assert list(decoder.decode(b"d\n")) == [b"bcd"]
    assert decoder.pending() is None


def test_leading_bom_is_dropped_even_split_across_chunks() -> None:
    assert decode_all([BOM + b"a\n" + BOM + b"b\n"]) == [b"a", BOM + b"b"]
    assert decode_all([BOM[:1], BOM[1:] + b"a", b"\n"]) == [b"a"]
    decoder = LineDecoder(1024, 16)
    decoder.decode(BOM + b"dat")
    assert decoder.pending() == b"dat"


def test_over_long_line_keeps_its_head_and_a_bounded_tail() -> None:
    decoder = LineDecoder(4096, 16)
    decoder.decode(b"data: ")
    for _ in range(100):
        assert list(decoder.decode(b"x" * 1000)) == []
        assert decoder.buffered <= 4096 + 16
    pending = decoder.pending()
    assert isinstance(pending, LongLine)
    assert pending.head == b"data: " + b"x" * 10
    (line, after) = decoder.decode(b"END\nnext\n")
    assert isinstance(line, LongLine)
    assert line.head == b"data: " + b"x" * 10
    assert line.tail.endswith(b"xEND")
    assert len(line.tail) <= 4096
    assert after == b"next"  # decoding resumes normally
    assert decoder.buffered == 0


def test_over_long_first_line_drops_the_bom_from_its_head() -> None:
    # Only a line carried over between chunks is bounded (one chunk is in memory anyway).
    (line,) = decode_all([BOM + b"data: ", b"x" * 5000 + b"\n"], max_line=4096)
    assert isinstance(line, LongLine)
    assert line.head.startswith(b"data: ")


# --- through the observer -------------------------------------------------------------------


def test_sse_crlf_split_between_chunks_does_not_end_the_event() -> None:
    # One event whose JSON spans two data lines (joined with "\n" per the SSE spec). A CRLF split
    # across chunks must not read as CR + empty line, which would dispatch half an event.
    usage = {"prompt_tokens": 30, "completion_tokens": 4, "total_tokens": 34}
    body = (
        'data: {"choices": [],\r\ndata: "usage": '
        + json.dumps(usage)
        + "}\r\n\r\ndata: [DONE]\r\n\r\n"
    ).encode()
    for chunks in ([body[i : i + 1] for i in range(len(body))], [body]):
        assert observe(chunks).result() == Usage(input_tokens=30, output_tokens=4)


def test_sse_leading_bom_is_ignored() -> None:
    body = BOM + sse({"choices": [], "usage": {"prompt_tokens": 4}})
    assert observe([body[i : i + 1] for i in range(len(body))]).result() == Usage(input_tokens=4)


def test_sse_absurdly_long_line_is_bounded_and_parsing_resumes() -> None:
    max_buffer = 1024 * 1024
    observer = UsageObserver("openai", SSE, max_buffer=max_buffer)
    observer.feed(b"data: ")
    for _ in range(20 * 16):  # a 20 MB line without a newline
        observer.feed(b"x" * 65536)
        assert retained_bytes(observer) <= max_buffer + 64
    observer.feed(b"\n\n" + sse({"choices": [], "usage": {"prompt_tokens": 2}}))
    assert observer.result() == Usage(input_tokens=2)
    assert retained_bytes(observer) == 0


def test_feeding_is_linear_in_body_size() -> None:
    # An 8 MB line in 256-byte chunks: re-scanning or re-copying the partial line per chunk
    # would move ~130 GB; linear processing takes well under a second.
    observer = UsageObserver("openai", SSE)
    chunk = b"z" * 256
    started = time.perf_counter()
    observer.feed(b"data: ")
    for _ in range(32 * 1024):
        observer.feed(chunk)
    observer.feed(b"\n\n")
    assert time.perf_counter() - started < 5.0
