"""Fixtures of the compat suite: the counting fake provider (one process for the session) and
the packages the gateways need (installed by the ``compat`` extra: missing ones skip locally
and FAIL under ``CI=true``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.services import require_modules

from .support import Provider, start_provider


@pytest.fixture(scope="session")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Provider]:
    fake = start_provider(Path(tmp_path_factory.mktemp("provider")))
    try:
        yield fake
    finally:
        fake.server.stop()


@pytest.fixture(scope="module")
def litellm_installed() -> None:
    require_modules("litellm", "fastapi", "orjson", "apscheduler")  # (no import: it is slow)


@pytest.fixture(scope="module")
def openai_forward_installed() -> None:
    require_modules("openai_forward", "aiohttp", "slowapi")
