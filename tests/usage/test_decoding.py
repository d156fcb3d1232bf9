"""Tests for spendguard.usage.decoding: usage from compressed bodies, estimates for unreadable."""

from __future__ import annotations

import gzip
import json
import zlib

import pytest

from spendguard.usage import Usage, UsageObserver, decoding, observer_for
from tests.support.bodies import JSON, SSE

CHAT = {
    "model": "gpt-x",
    "choices": [{"index": 0, "message": {"content": "hello there"}}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 3},
}
BODY = json.dumps(CHAT).encode()
USAGE = Usage(input_tokens=12, output_tokens=3)


def feed(observer: decoding.BodyObserver, data: bytes, size: int = 7) -> None:
    for start in range(0, len(data), size):
        observer.feed(data[start : start + size])


@pytest.mark.parametrize("encoding", ["", "identity", " Identity "])
def test_identity_reads_the_body_as_it_is(encoding: str) -> None:
    observer = observer_for("openai", JSON, encoding)
    assert isinstance(observer, UsageObserver)
    feed(observer, BODY)
    assert observer.result() == USAGE
    assert observer.model == "gpt-x"


@pytest.mark.parametrize(
    ("encoding", "compress"),
    [
        ("gzip", gzip.compress),
        ("x-gzip", gzip.compress),
        ("GZIP", gzip.compress),
        ("deflate", zlib.compress),
    ],
)
def test_gzip_and_deflate_are_decoded_on_the_side(encoding: str, compress: object) -> None:
    observer = observer_for("openai", JSON, encoding)
    feed(observer, compress(BODY))  # type: ignore[operator]
    assert observer.result() == USAGE
    assert observer.model == "gpt-x"
    assert observer.output_chars == len("hello there")


def test_gzip_stream_is_decoded_chunk_by_chunk() -> None:
    events = [
        {"type": "message_start", "message": {"model": "claude-x", "usage": {"input_tokens": 4}}},
        {"type": "content_block_delta", "delta": {"text": "abc"}},
        {"type": "message_delta", "usage": {"output_tokens": 2}},
    ]
    body = "".join(f"data: {json.dumps(event)}\n\n" for event in events).encode()
    observer = observer_for("anthropic", SSE, "gzip")
    feed(observer, gzip.compress(body), size=1)
    assert observer.result() == Usage(input_tokens=4, output_tokens=2)
    assert observer.output_chars == 3
    assert observer.model == "claude-x"


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "gzip, br"])
def test_unreadable_encoding_is_estimated_high_from_its_size(encoding: str) -> None:
    observer = observer_for("openai", JSON, encoding)
    feed(observer, b"\x00" * 100)
    assert observer.result() is None
    assert observer.model is None
    assert observer.output_chars == 400


def test_corrupt_gzip_falls_back_to_the_size_estimate() -> None:
    compressed = gzip.compress(BODY)
    corrupt = compressed[:10] + b"\xff" * 20 + compressed[30:]
    observer = observer_for("openai", JSON, "gzip")
    feed(observer, corrupt)
    assert observer.result() is None
    assert observer.output_chars == len(corrupt) * 4


class Recorder(UsageObserver):
    __slots__ = ("sizes",)

    def __init__(self) -> None:
        super().__init__("openai", JSON)
        self.sizes: list[int] = []

    def feed(self, chunk: bytes) -> None:
        self.sizes.append(len(chunk))
        super().feed(chunk)


def test_decoded_size_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    # A zip bomb stops being decoded at the limit, in bounded steps.
    monkeypatch.setattr(decoding, "_TOTAL", 1024 * 1024)
    inner = Recorder()
    observer = decoding._Inflating(inner)
    feed(observer, gzip.compress(b" " * (50 * 1024 * 1024)), size=64 * 1024)
    assert 1024 * 1024 <= sum(inner.sizes) <= 1024 * 1024 + decoding._STEP
    assert max(inner.sizes) <= decoding._STEP
