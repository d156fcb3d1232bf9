"""What the engine tells Prometheus and (optionally) OpenTelemetry about each inference.

The metrics are :mod:`spendguard.metrics`' pre-bound children: a decision is one ``inc``, a
charge three or four, each store call one ``observe`` (taken in the engine around its await).
Labels come from closed sets only (docs/metrics.md); who spent what is the ledger's to answer.

OpenTelemetry is an extra (``pip install 'spendguard[otel]'``). With ``SPENDGUARD_OTEL=true``
and ``opentelemetry-api`` importable, :func:`trace_guard` replaces the guard's ``preflight`` and
``postflight`` with versions that run inside a span each (on the tracer provider the app
configured); otherwise it changes nothing, so tracing off costs nothing per request.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import TYPE_CHECKING, Any

from .. import metrics
from ..limits import Balance, Limit, Target
from ..usage import Usage
from .decision import Decision, Unavailable, Verdict

if TYPE_CHECKING:
    from ..identity import Identity
    from ..record import InferenceRecord
    from .guard import SpendGuard

log = logging.getLogger("spendguard")

_ALLOWED_LIMITED = metrics.ALLOWED_BY_KIND["limited"]
_ALLOWED_UNLIMITED = metrics.ALLOWED_BY_KIND["unlimited"]
_ALLOWED_FAIL_OPEN = metrics.ALLOWED_BY_KIND["fail_open"]
_DENIED_BALANCE = metrics.DENIED_BY_KIND["balance"]
_DENIED_MODEL = metrics.DENIED_BY_KIND["model"]
_DENIED_RATE = metrics.DENIED_BY_KIND["rate"]
_DENIED_OTHER = metrics.DENIED_BY_KIND["other"]
_DENIED_BY_LIMIT = metrics.DENIED_BY_LIMIT
_ERRORS = metrics.ERROR_BY_KIND
_SPEND = metrics.SPEND
_INPUT, _OUTPUT, _CACHED, _CACHE_WRITE = metrics.TOKENS_BY_TYPE
# Decisions made before any limit is checked (admit() only).
_ADMISSION = {
    Verdict.PASS: metrics.ALLOWED_BY_KIND["unidentified"],
    Verdict.UNAUTHENTICATED: metrics.DENIED_BY_KIND["identity"],
    Verdict.UNPRICED: metrics.DENIED_BY_KIND["unpriced"],
}


def decided(
    verdict: Verdict,
    limited: bool,
    target: Target | None,
    fail_open: bool,
    unavailable: Unavailable | None,
) -> None:
    """Count one preflight decision: ``limited`` (a policy or balance was checked), the
    ``target`` that denied, the cause of an error."""
    if verdict is Verdict.ALLOW:
        if fail_open:
            _ALLOWED_FAIL_OPEN.inc()
        elif limited:
            _ALLOWED_LIMITED.inc()
        else:
            _ALLOWED_UNLIMITED.inc()
    elif verdict is Verdict.DENY:
        if isinstance(target, Limit):
            # StrEnum members hash as their values: the key is the label pair.
            key = (target.subject.kind, target.window)
            (_DENIED_BY_LIMIT.get(key) or _bind(_DENIED_BY_LIMIT, key)).inc()
        elif isinstance(target, Balance):
            _DENIED_BALANCE.inc()
        else:  # a target kind this mapping does not know yet: counted, never raised
            _DENIED_OTHER.inc()
    elif verdict is Verdict.MODEL_NOT_ALLOWED:
        _DENIED_MODEL.inc()
    elif verdict is Verdict.RATE_LIMITED:
        _DENIED_RATE.inc()
    elif unavailable is not None:
        (_ERRORS.get(unavailable) or _bind_error(unavailable)).inc()


def _bind(children: dict[tuple[str, str], Any], key: tuple[str, str]) -> Any:
    """The child of a limit kind or window added after this module was written (the label
    values still come from the code's enums, never from a request)."""
    children[key] = child = metrics.DECISIONS.labels(metrics.DENIED, str(key[0]), str(key[1]))
    return child


def _bind_error(cause: Unavailable) -> Any:
    _ERRORS[cause] = child = metrics.DECISIONS.labels(metrics.ERROR, cause.value, "none")
    return child


def admitted(verdict: Verdict) -> None:
    """Count a decision made before preflight (no identity, an unpriced model)."""
    _ADMISSION[verdict].inc()


def charged(estimate: int, usage: Usage) -> None:
    """Count what postflight charges: the estimate and its tokens."""
    _SPEND.inc(estimate)
    _INPUT.inc(usage.input_tokens)
    _OUTPUT.inc(usage.output_tokens)
    if usage.cached_input_tokens:
        _CACHED.inc(usage.cached_input_tokens)
    if usage.cache_write_tokens:
        _CACHE_WRITE.inc(usage.cache_write_tokens)


def labels_of(decision: Decision) -> tuple[str, str, str]:
    """A decision's (outcome, kind, period), as spendguard_decisions_total labels it."""
    verdict = decision.verdict
    if verdict is Verdict.ALLOW:
        kind = "fail_open" if decision.fail_open else "limited" if decision.limits else "unlimited"
        return metrics.ALLOWED, kind, metrics.NO_PERIOD
    if verdict is Verdict.DENY:
        target = decision.denied.check.target if decision.denied is not None else None
        if isinstance(target, Limit):
            return metrics.DENIED, target.subject.kind.value, target.window.value
        if isinstance(target, Balance):
            return metrics.DENIED, "balance", metrics.NO_PERIOD
        return metrics.DENIED, "other", metrics.NO_PERIOD
    if verdict is Verdict.MODEL_NOT_ALLOWED:
        return metrics.DENIED, "model", metrics.NO_PERIOD
    if verdict is Verdict.RATE_LIMITED:
        return metrics.DENIED, "rate", metrics.NO_PERIOD
    cause = decision.unavailable.value if decision.unavailable is not None else "store"
    return metrics.ERROR, cause, metrics.NO_PERIOD


# -- OpenTelemetry (optional) -----------------------------------------------------------------


def store_name(store: object) -> str:
    """``memory``, ``redis``, ``redis_cluster`` or the store class's name: a span attribute."""
    store = getattr(store, "inner", store)  # a wrapping store (e.g. a test's counting double)
    name = type(store).__name__
    if name == "MemoryStore":
        return "memory"
    if name == "RedisStore":
        client = getattr(store, "_client", None)
        return "redis_cluster" if type(client).__name__ == "RedisCluster" else "redis"
    return name


def trace_guard(guard: SpendGuard, enabled: bool) -> bool:
    """Wrap ``guard``'s preflight and postflight in spans when tracing is enabled and
    ``opentelemetry-api`` is importable; True if it did."""
    if not enabled:
        return False
    try:
        from opentelemetry import trace
    except ImportError:
        log.warning(
            "SPENDGUARD_OTEL is set but opentelemetry-api is not installed "
            "(pip install 'spendguard[otel]'): no spans"
        )
        return False
    from .. import __version__

    tracer = trace.get_tracer("spendguard", __version__)
    store = store_name(guard.store)
    preflight, postflight = guard.preflight, guard.postflight
    error = trace.Status(trace.StatusCode.ERROR)

    async def traced_preflight(
        identity: Identity,
        t0: datetime,
        *,
        inference_id: str | None = None,
        request: Any = None,
        route: str = "",
        now: datetime | None = None,
        tentative: bool = False,
        record_id: str | None = None,
    ) -> Decision:
        with tracer.start_as_current_span("spendguard.preflight") as span:
            decision = await preflight(
                identity,
                t0,
                inference_id=inference_id,
                request=request,
                route=route,
                now=now,
                tentative=tentative,
                record_id=record_id,
            )
            outcome, kind, period = labels_of(decision)
            span.set_attributes(
                {
                    "spendguard.store": store,
                    "spendguard.outcome": outcome,
                    "spendguard.limit.kind": kind,
                    "spendguard.limit.period": period,
                    "spendguard.limits_checked": len(decision.limits),
                }
            )
            if decision.retry_after is not None:
                span.set_attribute("spendguard.retry_after", decision.retry_after)
            if outcome == metrics.ERROR:
                span.set_status(error)
            return decision

    async def traced_postflight(
        decision: Decision, *, model: str, route: str, status_code: int, usage: Usage
    ) -> InferenceRecord | None:
        with tracer.start_as_current_span("spendguard.postflight") as span:
            record = await postflight(
                decision, model=model, route=route, status_code=status_code, usage=usage
            )
            attributes: dict[str, str | int | bool] = {
                "spendguard.store": store,
                "spendguard.status_code": status_code,
                "spendguard.charged": record is not None,
            }
            if record is not None:
                attributes |= {
                    "spendguard.cost_micros": record.estimate_micros,
                    "spendguard.model": record.model,
                    "spendguard.input_tokens": record.usage.input_tokens,
                    "spendguard.output_tokens": record.usage.output_tokens,
                    "spendguard.usage_estimated": record.usage.estimated,
                    "spendguard.postflight": record.postflight.value,
                }
            span.set_attributes(attributes)
            return record

    guard.preflight = traced_preflight  # type: ignore[method-assign]
    guard.postflight = traced_postflight  # type: ignore[method-assign]
    return True
