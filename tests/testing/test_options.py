"""The fake's options (spendguard.testing.options): validation and ``x-fake-*`` overrides."""

from __future__ import annotations

import anyio
import pytest
from starlette.datastructures import Headers

from spendguard.testing import expected_usage, fake_upstream
from spendguard.testing.options import Options, options_for
from tests.testing.wire import CHAT, MESSAGE, TIME_LIMIT, raw_client


def test_options_are_validated() -> None:
    for bad in (
        {"fail_status": 200},
        {"fail_status": 600},
        {"chunks": -1},
        {"stall_after": -1},
        {"stop_after": -2},
        {"output_tokens": -3},
        {"delay": -0.1},
        {"delay": float("nan")},
    ):
        with pytest.raises(ValueError):
            fake_upstream(**bad)


def test_headers_override_the_defaults_field_by_field() -> None:
    defaults = Options(fail_status=500, chunks=7, stall_after=2)
    assert options_for(defaults, Headers({})) is defaults
    changed = options_for(
        defaults,
        Headers(
            {
                "x-fake-fail": "0",
                "x-fake-usage": " Off ",
                "x-fake-stall-after": "none",
                "x-fake-stop-after": "4",
                "x-fake-output-tokens": "",
                "x-fake-delay": "0.5",
            }
        ),
    )
    assert changed == Options(
        report_usage=False, fail_status=None, stall_after=None, stop_after=4, chunks=7, delay=0.5
    )


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("x-fake-usage", "maybe"),
        ("x-fake-chunks", "lots"),
        ("x-fake-chunks", "-1"),
        ("x-fake-fail", "200"),
        ("x-fake-delay", "inf"),
    ],
)
def test_a_bad_header_value_is_reported_by_name(header: str, value: str) -> None:
    with pytest.raises(ValueError, match="x-fake-"):
        options_for(Options(), Headers({header: value}))


@pytest.mark.anyio
async def test_header_overrides() -> None:
    healthy, failing = fake_upstream(), fake_upstream(fail_status=500)
    with anyio.fail_after(TIME_LIMIT):
        async with raw_client(healthy) as client:
            fail = await client.post(
                "/v1/chat/completions", json=CHAT, headers={"x-fake-fail": "502"}
            )
            no_usage = await client.post(
                "/v1/chat/completions", json=CHAT, headers={"x-fake-usage": "0"}
            )
            three = await client.post(
                "/v1/chat/completions", json=CHAT, headers={"x-fake-chunks": "3"}
            )
            many = await client.post(
                "/v1/messages", json=MESSAGE, headers={"x-fake-output-tokens": "321"}
            )
            bad = await client.post("/v1/messages", json=MESSAGE, headers={"x-fake-chunks": "lots"})
        async with raw_client(failing) as client:
            rescued = await client.post(
                "/v1/chat/completions", json=CHAT, headers={"x-fake-fail": "0"}
            )
            usage_on = await client.post(
                "/v1/chat/completions",
                json=CHAT,
                headers={"x-fake-fail": "none", "x-fake-usage": "1"},
            )
    assert fail.status_code == 502
    assert "usage" not in no_usage.json()
    assert three.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2"
    assert three.json()["usage"]["completion_tokens"] == 3
    assert many.json()["usage"]["output_tokens"] == 321
    assert (
        many.json()["usage"]["input_tokens"] == expected_usage("/v1/messages", MESSAGE).input_tokens
    )
    assert bad.status_code == 400
    assert "x-fake-chunks" in bad.json()["error"]["message"]
    assert rescued.status_code == 200
    assert usage_on.status_code == 200 and "usage" in usage_on.json()


@pytest.mark.anyio
async def test_delay_option_and_header() -> None:
    with anyio.fail_after(TIME_LIMIT):
        async with raw_client(fake_upstream(delay=0.2)) as client:
            start = anyio.current_time()
            await client.post("/v1/chat/completions", json=CHAT)
            assert anyio.current_time() - start >= 0.2
        async with raw_client(fake_upstream()) as client:
            start = anyio.current_time()
            await client.post("/v1/chat/completions", json=CHAT, headers={"x-fake-delay": "0.2"})
            assert anyio.current_time() - start >= 0.2
            bad = await client.post(
                "/v1/chat/completions", json=CHAT, headers={"x-fake-delay": "-1"}
            )
    assert bad.status_code == 400
