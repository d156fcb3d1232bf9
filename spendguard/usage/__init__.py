"""Token usage of provider responses, read from the body as it streams past.

:func:`observer_for` picks the :class:`BodyObserver` for a response's ``Content-Encoding``;
:class:`UsageObserver` reads the (decoded) body of either :class:`Dialect` and reports the
provider's :class:`Usage`; :func:`estimate_usage` stands in when it reported none.

Modules, one concern each: ``types`` (the values), ``lines`` (bytes to lines), ``sse`` (lines to
events), ``tail`` (bodies larger than the buffer), ``chars`` (generated-text counting),
``openai`` and ``anthropic`` (each provider's format), ``shapes`` (text deltas counted without
a parse), ``observer`` (the glue) and ``decoding`` (compressed bodies).
"""

from __future__ import annotations

from .decoding import BodyObserver, observer_for
from .observer import UsageObserver
from .types import Dialect, Usage, estimate_usage

__all__ = ["BodyObserver", "Dialect", "Usage", "UsageObserver", "estimate_usage", "observer_for"]
