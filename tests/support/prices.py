"""A price table where one token costs exactly one micro-USD, so expected charges are obvious."""

from __future__ import annotations

import json
from pathlib import Path

UNIT_MODEL = "unit-model"
UNIT_PRICES = {
    "as_of": "2026-11-01",
    "models": {
        UNIT_MODEL: {"input": "1", "output": "1", "cached_input": "1"},
        "default": {"input": "1", "output": "1"},
    },
}


def write_unit_prices(directory: Path) -> Path:
    """Write the unit table as ``prices.json`` in ``directory`` and return its path."""
    path = directory / "prices.json"
    path.write_text(json.dumps(UNIT_PRICES))
    return path
