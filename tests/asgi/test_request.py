"""Tests for spendguard.asgi.request: validating inference requests before the provider call."""

from __future__ import annotations

import json
import random

import pytest

from spendguard.asgi.request import BadRequest, parse_request
from spendguard.engine.decision import InferenceRequest
from tests.support import Counting


def body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


# --- valid requests -------------------------------------------------------------------------


def test_openai_chat_request() -> None:
    content = "x" * 40
    request = parse_request(
        body(model="gpt-4o-mini", messages=[{"role": "user", "content": content}], max_tokens=50)
    )
    # Strings counted: "user" (4) + content (40) = 44 chars -> 11 tokens.
    assert request == InferenceRequest(
        model="gpt-4o-mini", stream=False, max_tokens=50, estimated_input_tokens=11
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x" * 41}]},
        {"model": "claude-sonnet-4-6", "system": "s" * 9, "messages": [], "max_tokens": 5},
        {"model": "gpt-5-nano", "input": [[1, 2, 3], "abc"], "instructions": "i" * 7},
        {"model": "gpt-4o", "messages": [{"role": "user", "content": "data:image/png;x"}]},
    ],
)
def test_an_estimate_wanted_at_admission_comes_from_the_one_parse(
    fields: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With budgets on, every request's input estimate is held at admission: it is taken from
    the parse that validated the body, not from a second one, and equals the lazy one."""
    from spendguard.asgi import request as module

    parses = Counting(module)
    monkeypatch.setattr(module, "_load", parses._load)
    raw = body(**fields)
    lazy = parse_request(raw).estimated_input_tokens
    assert parses.calls["_load"] == 2  # validated, then parsed again when first asked
    parses.calls.clear()
    assert parse_request(raw, estimate_now=True).estimated_input_tokens == lazy
    assert parses.calls["_load"] == 1


def test_anthropic_streaming_request_counts_system_and_content_blocks() -> None:
    request = parse_request(
        body(
            model="claude-sonnet-4-6",
            stream=True,
            max_tokens=1024,
            system=[{"type": "text", "text": "s" * 100}],
            messages=[{"role": "user", "content": [{"type": "text", "text": "u" * 96}]}],
        )
    )
    assert request.model == "claude-sonnet-4-6"
    assert request.stream is True
    assert request.max_tokens == 1024
    # "text" x2 (8) + 100 + "user" (4) + 96 = 208 chars -> 52 tokens.
    assert request.estimated_input_tokens == 52


def test_responses_request_uses_max_output_tokens_and_instructions() -> None:
    request = parse_request(
        body(model="gpt-5-nano", input="i" * 10, instructions="j" * 10, max_output_tokens=300)
    )
    assert request.max_tokens == 300
    assert request.estimated_input_tokens == 5  # ceil(20 / 4)


def test_max_completion_tokens_and_largest_cap_wins() -> None:
    assert parse_request(body(model="o3", max_completion_tokens=77)).max_tokens == 77
    both = body(model="o3", max_tokens=10, max_completion_tokens=500)
    assert parse_request(both).max_tokens == 500


@pytest.mark.parametrize("value", [None, 0, 1, 10_000_000])
def test_max_tokens_boundaries_accepted(value: int | None) -> None:
    assert parse_request(body(model="m", max_tokens=value)).max_tokens == value


def test_no_max_tokens_and_no_prompt() -> None:
    request = parse_request(body(model="m"))
    assert request.max_tokens is None
    assert request.stream is False
    assert request.estimated_input_tokens == 1  # at least 1


def test_stream_false_and_null_mean_not_streaming() -> None:
    assert parse_request(body(model="m", stream=False)).stream is False
    assert parse_request(body(model="m", stream=None)).stream is False


def test_model_of_exactly_256_characters_accepted() -> None:
    assert parse_request(body(model="m" * 256)).model == "m" * 256


def test_estimate_ignores_non_prompt_fields_and_keys() -> None:
    request = parse_request(
        body(model="m", prompt="abcd", user="u" * 1000, metadata={"k": "v" * 99})
    )
    assert request.estimated_input_tokens == 1


def test_estimate_counts_legacy_prompt_and_token_arrays() -> None:
    assert parse_request(body(model="m", prompt="p" * 21)).estimated_input_tokens == 6
    # Embeddings/Completions accept pre-tokenised input: one token per integer.
    assert parse_request(body(model="m", input=[[1, 2, 3], [4, 5]])).estimated_input_tokens == 5


def test_estimate_skips_base64_media() -> None:
    image = "data:image/png;base64," + "A" * 400_000
    request = parse_request(
        body(
            model="m",
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "data": "B" * 400_000}}
                    ],
                },
            ],
        )
    )
    assert request.estimated_input_tokens < 20


def test_estimate_counts_tools() -> None:
    tool = {"type": "function", "function": {"name": "f", "description": "d" * 400}}
    assert parse_request(body(model="m", tools=[tool])).estimated_input_tokens > 100


def test_deep_but_legal_prompt_is_counted_without_recursion() -> None:
    nested: object = "z" * 8
    for _ in range(500):
        nested = [nested]
    assert parse_request(body(model="m", messages=nested)).estimated_input_tokens == 2


def test_bytearray_and_whitespace_accepted() -> None:
    raw = bytearray(b'  \n{"model": "m", "stream": true}\n')
    assert parse_request(bytes(raw)).stream is True
    assert parse_request(raw).stream is True  # type: ignore[arg-type]


# --- rejected requests ----------------------------------------------------------------------

BAD_BODIES: list[tuple[str, bytes, str | None, str]] = [
    ("empty", b"", None, "empty"),
    ("whitespace", b" \n ", None, "empty"),
    ("invalid utf-8", b'{"model": "\xff\xfe"}', None, "UTF-8"),
    ("invalid json", b'{"model": "m",}', None, "not valid JSON"),
    ("truncated json", b'{"model": "m"', None, "not valid JSON"),
    ("NaN", b'{"model": "m", "temperature": NaN}', None, "non-finite"),
    ("Infinity", b'{"model": "m", "temperature": Infinity}', None, "non-finite"),
    ("-Infinity", b'{"model": "m", "temperature": -Infinity}', None, "non-finite"),
    ("overflowing float", b'{"model": "m", "temperature": 1e999}', None, "non-finite"),
    ("huge integer literal", b'{"model": "m", "seed": ' + b"9" * 5000 + b"}", None, "JSON"),
    (
        "deeply nested",
        b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        None,
        "deep",
    ),
    ("top-level array", b'[{"model": "m"}]', None, "JSON object"),
    ("top-level string", b'"model"', None, "JSON object"),
    ("top-level null", b"null", None, "JSON object"),
    ("model missing", b'{"messages": []}', "model", "required"),
    ("model null", b'{"model": null}', "model", "required"),
    ("model number", b'{"model": 4}', "model", "string"),
    ("model list", b'{"model": ["gpt-4o"]}', "model", "string"),
    ("model empty", b'{"model": ""}', "model", "empty"),
    ("model blank", b'{"model": "   "}', "model", "empty"),
    ("model too long", body(model="m" * 257), "model", "too long"),
    ("model control char", body(model="gpt\n4o"), "model", "control"),
    ("stream string", b'{"model": "m", "stream": "true"}', "stream", "boolean"),
    ("stream int", b'{"model": "m", "stream": 1}', "stream", "boolean"),
    ("stream object", b'{"model": "m", "stream": {}}', "stream", "boolean"),
]
for _field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
    BAD_BODIES += [
        (f"{_field} string", body(model="m", **{_field: "5"}), _field, "integer"),
        (f"{_field} float", body(model="m", **{_field: 5.0}), _field, "integer"),
        (f"{_field} fraction", body(model="m", **{_field: 5.5}), _field, "integer"),
        (f"{_field} bool", body(model="m", **{_field: True}), _field, "integer"),
        (f"{_field} list", body(model="m", **{_field: [5]}), _field, "integer"),
        (f"{_field} negative", body(model="m", **{_field: -1}), _field, "negative"),
        (f"{_field} too large", body(model="m", **{_field: 10_000_001}), _field, "at most"),
    ]


@pytest.mark.parametrize(
    ("raw", "param", "fragment"),
    [case[1:] for case in BAD_BODIES],
    ids=[case[0] for case in BAD_BODIES],
)
def test_bad_request(raw: bytes, param: str | None, fragment: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_request(raw)
    error = caught.value
    assert error.status == 400
    assert fragment in error.message
    assert str(error) == error.message
    if param is not None:
        assert param in error.message  # the message names the offending field


def test_bad_request_attributes() -> None:
    error = BadRequest("nope", status=413)
    assert (error.message, error.status) == ("nope", 413)
    assert BadRequest("a").status == 400


def test_random_bytes_only_ever_raise_bad_request() -> None:
    rng = random.Random(7)
    seeds = [b'{"model": "m", "max_tokens": 5, "messages": [{"content": "hi"}]}', b"[]", b"{}"]
    for _ in range(2000):
        raw = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            if raw and rng.random() < 0.5:
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            else:
                raw.insert(rng.randint(0, len(raw)), rng.randrange(256))
        try:
            request = parse_request(bytes(raw))
        except BadRequest:
            continue
        assert isinstance(request, InferenceRequest)
        assert request.estimated_input_tokens >= 1
