"""The live budgets config: a file polled for changes, or a fixed section.

A request asks for :meth:`BudgetsSource.current`; at most once per ``poll_seconds`` (1 s by
default) that looks at the file's modification time and size, and re-reads it when they
changed. An edit therefore applies from the first request after it is noticed, at most about a
second later. An invalid edit is logged and ignored: the last valid config stays in force.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from .config import DISABLED, BudgetConfigError, BudgetsConfig, read_budgets

log = logging.getLogger("spendguard.budgets")


class BudgetsSource:
    def __init__(
        self,
        config: BudgetsConfig = DISABLED,
        *,
        path: Path | None = None,
        poll_seconds: float = 1.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._path = path
        self._poll = poll_seconds
        self._monotonic = monotonic
        self._checked = monotonic()
        self._signature = self._stat()

    @classmethod
    def from_file(cls, path: Path, **options: float | Callable[[], float]) -> BudgetsSource:
        """A source for ``path``, read now (a BudgetConfigError if it is invalid at start)."""
        return cls(read_budgets(path), path=path, **options)  # type: ignore[arg-type]

    @property
    def path(self) -> Path | None:
        return self._path

    def _stat(self) -> tuple[int, int] | None:
        if self._path is None:
            return None
        try:
            st = os.stat(self._path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def current(self) -> BudgetsConfig:
        if self._path is None:
            return self._config
        now = self._monotonic()
        if now - self._checked >= self._poll:
            self._checked = now
            self.reload()
        return self._config

    def reload(self) -> bool:
        """Re-read the file if it changed; True when a new config took effect."""
        signature = self._stat()
        if signature is None or signature == self._signature or self._path is None:
            return False
        self._signature = signature
        try:
            config = read_budgets(self._path)
        except BudgetConfigError as exc:
            log.error("budgets file %s rejected, the previous config stays: %s", self._path, exc)
            return False
        self._config = config
        log.info("budgets file %s reloaded (enabled=%s)", self._path, config.enabled)
        return True
