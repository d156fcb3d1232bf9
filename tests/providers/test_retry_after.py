from __future__ import annotations

from datetime import UTC, datetime

import pytest

from spendguard.providers import retry_after_seconds

NOW = datetime(2026, 9, 30, 12, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry-after": "20"}, 20.0),
        ({"retry-after": " 1.5 "}, 1.5),
        ({"retry-after-ms": "250", "retry-after": "20"}, 0.25),  # the finer one wins
        ({"retry-after": "Wed, 30 Sep 2026 12:00:45 GMT"}, 45.0),
        ({"retry-after": "Wed, 30 Sep 2026 11:59:00 GMT"}, 0.0),  # already past
        ({}, 7.0),
        ({"retry-after": "soon"}, 7.0),
        ({"retry-after": "-5"}, 7.0),
        ({"retry-after": "inf"}, 7.0),
        ({"retry-after-ms": "nan"}, 7.0),
    ],
)
def test_retry_after(headers: dict[str, str], expected: float) -> None:
    assert retry_after_seconds(headers, default=7.0, now=NOW) == expected
