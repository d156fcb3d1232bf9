"""What a hard spend limit (and a TPM rate) holds for a request, and the refusal of a request
whose hold alone exceeds the limit's whole amount: no wait ever lets it pass as sent, so it gets
``request_exceeds_spend_limit`` with ``x-should-retry: false``, no ``Retry-After``, and a
message that says what the hold is made of and which ``max_tokens`` would fit.

The unit price table charges one micro-USD per token; the hold's input is the body's size in
tokens (4 bytes each).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from spendguard.limits import Period
from spendguard.usage.types import chars_to_tokens
from tests.support import Gateway, chat_body

pytestmark = pytest.mark.anyio

LIMIT = 1000  # micro-USD: a hard daily limit of a tenth of a cent


@pytest.fixture
async def gw(tmp_path: Path) -> Any:
    async with Gateway(tmp_path) as gateway:
        await gateway.guard.admin.set_policy(
            "acme", "alpha", window=Period.DAY, limit_usd="0.001", hard=True
        )
        yield gateway


async def post(c: httpx.AsyncClient, path: str = "/v1/chat/completions", **extra: Any) -> Any:
    """A chat request and the tokens its body's size is held at."""
    raw = json.dumps(chat_body(**extra)).encode()
    headers = {"content-type": "application/json"}
    return await c.post(path, content=raw, headers=headers), chars_to_tokens(len(raw))


async def test_a_hold_beyond_the_whole_limit_never_passes_so_set_max_tokens(gw: Gateway) -> None:
    async with gw.client() as c:
        denied, tokens_in = await post(c)
        # The advice is right: the max_tokens it names fits (with its field in the body).
        fitting = LIMIT - tokens_in - 10
        ok, _ = await post(c, max_tokens=fitting)
    assert denied.status_code == 429
    assert denied.json() == {
        "error": {
            "type": "request_exceeds_spend_limit",
            "code": "request_exceeds_spend_limit",
            "message": "This request can never pass the API Key daily spend limit of $0.001 "
            f"as sent: it reserves ${(tokens_in + 4096) / 1e6:.6f} for {tokens_in} input and "
            "4,096 output tokens (it sets no max_tokens, so the default output reservation "
            f"applies). Set max_tokens to at most {fitting}.",
        }
    }
    assert denied.headers["x-should-retry"] == "false"
    assert "retry-after" not in denied.headers
    assert ok.status_code == 200, ok.text
    assert gw.postflights == 1  # the refused one never reached the provider


async def test_a_declared_max_tokens_too_large_is_told_to_lower_it(gw: Gateway) -> None:
    async with gw.client() as c:
        denied, tokens_in = await post(c, max_tokens=5000)
        anthropic_style, _ = await post(c, "/v1/messages", max_tokens=5000)
        ok, _ = await post(c, max_tokens=LIMIT - tokens_in)  # no more digits: it fits
    message = denied.json()["error"]["message"]
    assert message.endswith(
        f"for {tokens_in} input and 5,000 output tokens (its max_tokens). "
        f"Lower max_tokens to at most {LIMIT - tokens_in}."
    )
    # Anthropic's envelope has no code: its type says the request itself must change.
    assert anthropic_style.status_code == 429
    assert anthropic_style.json()["error"]["type"] == "invalid_request_error"
    for refused in (denied, anthropic_style):
        assert refused.headers["x-should-retry"] == "false"
        assert "retry-after" not in refused.headers
    assert ok.status_code == 200, ok.text


async def test_a_hold_that_fits_the_whole_limit_waits_for_the_reset(gw: Gateway) -> None:
    async with gw.client() as c:
        first, tokens_in = await post(c, max_tokens=500)
        assert first.status_code == 200
        # 15 used: this hold fits the limit, not what is left of it today.
        denied, _ = await post(c, max_tokens=LIMIT - tokens_in)
    assert denied.json()["error"]["code"] == "spend_limit_exceeded"
    assert denied.headers["retry-after"] == str(12 * 3600)  # at midnight UTC


async def test_a_request_too_large_for_its_tpm_without_max_tokens_is_told_to_set_it(
    tmp_path: Path,
) -> None:
    async with Gateway(tmp_path) as gw, gw.client() as c:
        await gw.guard.admin.set_rates("acme", "alpha", tpm=2000)
        denied, tokens_in = await post(c)
    assert denied.status_code == 429 and denied.headers["x-should-retry"] == "false"
    assert denied.json()["error"]["message"] == (
        f"Request too large for API Key on tokens per minute: limit 2000, requested "
        f"{tokens_in + 4096}. It sets no max_tokens, so the default output reservation "
        "counts: set max_tokens, or shorten the prompt."
    )


async def test_the_default_output_reservation_is_what_a_hard_limit_holds(
    tmp_path: Path,
) -> None:
    async with Gateway(tmp_path, default_output_tokens=500) as gw, gw.client() as c:
        await gw.guard.admin.set_policy(
            "acme", "alpha", window=Period.DAY, limit_usd="0.001", hard=True
        )
        ok, _ = await post(c)
    assert ok.status_code == 200, ok.text
