"""Alert thresholds: whole percentages of a limit, as every limit kind is given them."""

from __future__ import annotations

from collections.abc import Iterable

MAX_PERCENT = 1000  # past the limit still means something for a soft limit (200 %: twice)


def parse_thresholds(value: str | Iterable[int | str]) -> tuple[int, ...]:
    """``"50,80,100"`` (or numbers) -> (50, 80, 100): whole percentages from 1 to 1000, sorted,
    each once. ValueError names what is wrong."""
    parts = value.split(",") if isinstance(value, str) else list(value)
    out: set[int] = set()
    for part in parts:
        text = str(part).strip().removesuffix("%")
        if not text:
            continue
        if not text.isdigit() or not 1 <= int(text) <= MAX_PERCENT:
            raise ValueError(
                f"alert threshold {part!r} is not a whole percentage from 1 to {MAX_PERCENT}"
            )
        out.add(int(text))
    return tuple(sorted(out))
