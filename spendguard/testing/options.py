"""The fake's options: the app-wide defaults and their per-request ``x-fake-*`` header overrides."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from starlette.datastructures import Headers


@dataclass(frozen=True, slots=True)
class Options:
    """How the fake answers: see :func:`~spendguard.testing.fake_upstream` for each field."""

    report_usage: bool = True
    fail_status: int | None = None
    stall_after: int | None = None
    stop_after: int | None = None
    chunks: int = 5
    output_tokens: int | None = None
    delay: float = 0.0

    def __post_init__(self) -> None:
        if self.fail_status is not None and not 400 <= self.fail_status <= 599:
            raise ValueError(
                f"fail_status must be an HTTP error status 400-599: {self.fail_status}"
            )
        for name in ("stall_after", "stop_after", "output_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0: {value}")
        if self.chunks < 0:
            raise ValueError(f"chunks must be >= 0: {self.chunks}")
        if not math.isfinite(self.delay) or self.delay < 0:
            raise ValueError(f"delay must be a finite number of seconds >= 0: {self.delay}")


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 1/0/true/false")


def parse_int(text: str) -> int:
    return int(text.strip())


def parse_optional_int(text: str) -> int | None:
    # An empty value or "none" switches a failure mode off for one request.
    stripped = text.strip().lower()
    return None if stripped in ("", "none") else int(stripped)


def parse_status(text: str) -> int | None:
    # 0 means "no failure", so a header can switch off an app-wide fail_status.
    status = parse_optional_int(text)
    return None if status == 0 else status


HEADER_OPTIONS: Final[Mapping[str, tuple[str, Callable[[str], Any]]]] = {
    "x-fake-fail": ("fail_status", parse_status),
    "x-fake-usage": ("report_usage", parse_bool),
    "x-fake-stall-after": ("stall_after", parse_optional_int),
    "x-fake-stop-after": ("stop_after", parse_optional_int),
    "x-fake-chunks": ("chunks", parse_int),
    "x-fake-output-tokens": ("output_tokens", parse_optional_int),
    "x-fake-delay": ("delay", float),
}
"""Header → (option field, parser) of every per-request override."""


def options_for(defaults: Options, headers: Headers) -> Options:
    """``defaults`` with the request's ``x-fake-*`` headers applied.

    Raises ValueError, naming the header, when a value does not parse or is out of range.
    """
    changes: dict[str, Any] = {}
    for header, (field, parse) in HEADER_OPTIONS.items():
        raw = headers.get(header)
        if raw is None:
            continue
        try:
            changes[field] = parse(raw)
        except ValueError as exc:
            raise ValueError(f"invalid {header} header {raw!r}: {exc}") from exc
    if not changes:
        return defaults
    try:
        return dataclasses.replace(defaults, **changes)
    except ValueError as exc:
        raise ValueError(f"invalid x-fake-* header: {exc}") from exc
