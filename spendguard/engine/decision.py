"""What the engine decides about an inference, as typed values (design.md, "One inference").

:class:`Decision` is the outcome of a preflight (the store's answer); :class:`Admission` is the
outcome of admitting one inference end to end (identity, model rule, preflight), which the
ASGI adapter renders without interpreting anything.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from enum import IntEnum, StrEnum

from ..identity import Identity
from ..limits import Limit
from ..limits.rates import RateDenial, RateState
from ..store import LimitState
from ..usage import Dialect


class Verdict(StrEnum):
    ALLOW = "allow"  # checked: call the provider; finishing the inference charges it
    DENY = "deny"  # a limit or the balance is used up: 429
    UNAVAILABLE = "unavailable"  # the store or the ledger could not answer: 503
    # Admission only (no limit was checked):
    PASS = "pass"  # no identity, and unidentified requests may pass: not limited, not recorded
    UNAUTHENTICATED = "unauthenticated"  # no identity: 401
    UNPRICED = "unpriced"  # the model has no price and unknown models are rejected: 400
    MODEL_NOT_ALLOWED = "model_not_allowed"  # not on the key's (or team's) model list: 403
    RATE_LIMITED = "rate_limited"  # a rate (RPM, TPM, parallel) of the key or team: 429


class Unavailable(StrEnum):
    """Why a decision is UNAVAILABLE."""

    STORE = "store"  # the store did not answer (and failing open did not apply)
    STORE_FULL = "store_full"  # the embedded store is at its bound
    LEDGER = "ledger"  # a cache miss needed the ledger, which did not answer
    VANISHED = "vanished"  # cache keys kept disappearing while being filled


class Never(StrEnum):
    """Why a spend-limit refusal can never pass, however long the client waits."""

    ANY = "any"  # the limit is $0: no request passes until it is raised
    AS_SENT = "as_sent"  # the request's hold alone exceeds the hard limit's whole amount


class Lasting(IntEnum):
    """How long a refusal lasts: when several checks refuse one request, the answer names the
    one that lasts longest (the highest kind, then the longest wait)."""

    OUTAGE = 0  # a check could not answer: it is retried shortly
    WAIT = 1  # it passes once a window resets or drains (Retry-After)
    AS_SENT = 2  # it never passes as sent (a smaller max_tokens or prompt may)
    NEVER = 3  # no request passes: a $0 limit, an exhausted balance, a model refused


# Made on every request: not frozen, since a frozen dataclass's __init__ sets each field
# through object.__setattr__ (about 7x the cost). Hashed and compared by value like one;
# never assigned to after it is made.
@dataclass(slots=True, unsafe_hash=True)
class Decision:
    verdict: Verdict
    identity: Identity
    t0: datetime
    record_id: str
    inference_id: str
    limits: tuple[LimitState, ...] = ()  # policy-bearing limits: what postflight charges
    retry_after: int | None = None
    fail_open: bool = False  # allowed without the store (it was down): tracked locally
    unavailable: Unavailable | None = None
    # The team's entries hash when preflight wrote this inference's admission entry (a shared
    # store): finishing it closes the entry.
    entry_key: str | None = None
    # The rated scopes (the key's, then the team's) as preflight left them; the rate that
    # denied; the rate hashes in which the inference is in flight (finishing it closes them).
    rates: tuple[RateState, ...] = ()
    rate_denied: RateDenial | None = None
    rate_keys: tuple[str, ...] = ()
    # The request's end user, tags and customer, which its record carries.
    end_user: str | None = None
    tags: tuple[str, ...] = ()
    customer: str | None = None

    @property
    def denied(self) -> LimitState | None:
        """The limit (or balance) that denied, the last one checked."""
        return self.limits[-1] if self.verdict is Verdict.DENY and self.limits else None

    @property
    def denied_limit(self) -> Limit | None:
        """The spend limit that denied; None for a balance denial or no denial."""
        denied = self.denied
        target = None if denied is None else denied.check.target
        return target if isinstance(target, Limit) else None

    @property
    def balance_exhausted(self) -> bool:
        denied = self.denied
        return denied is not None and denied.is_balance


class InferenceRequest:
    """What spendguard needs from an inference request to check and charge it.

    ``estimated_input_tokens`` is the rough prompt size, ceil(prompt characters / 4) and at
    least 1. It is needed only when the provider reports no usage (a disconnect, a stream
    without usage), so a parser may pass ``estimate`` instead, called on first use: most
    requests never walk their prompt a second time.
    """

    __slots__ = (
        "_estimate",
        "_estimated",
        "choices",
        "customer",
        "end_user",
        "max_tokens",
        "model",
        "model_pinned",
        "size",
        "stream",
        "tags",
    )

    def __init__(
        self,
        model: str,
        stream: bool,
        max_tokens: int | None,
        estimated_input_tokens: int | None = None,
        *,
        estimate: Callable[[], int] | None = None,
        size: int = 0,
        choices: int = 1,
        model_pinned: bool = False,
    ) -> None:
        if (estimated_input_tokens is None) == (estimate is None):
            raise TypeError("give estimated_input_tokens or estimate, not both or neither")
        self.model = model
        # The route names the model (an Azure deployment): the upstream runs it whatever the
        # body or the response calls it, so the response's model name does not replace it.
        self.model_pinned = model_pinned
        self.size = size  # bytes of the request body, 0 when unknown
        self.choices = choices  # completions asked for (OpenAI's n)
        self.stream = stream
        self.max_tokens = max_tokens  # output cap (the largest of the APIs' cap fields)
        self._estimated = estimated_input_tokens
        self._estimate = estimate
        # Who the app bills within its team, and what the request is for (raw values as the
        # app, or the settings' trusted source, gave them): their budgets apply, their records
        # say so (design.md, "End users, tags and customers").
        self.end_user: str | None = None
        self.tags: tuple[str, ...] = ()
        self.customer: str | None = None  # the organisation above the team

    @property
    def estimated_input_tokens(self) -> int:
        if self._estimated is None:
            assert self._estimate is not None
            self._estimated = self._estimate()
            self._estimate = None
        return self._estimated

    def capped(self, max_tokens: int) -> InferenceRequest:
        """The same request with its output cap lowered to ``max_tokens`` (fitted)."""
        out = copy.copy(self)
        out.max_tokens = max_tokens
        return out

    def _key(self) -> tuple[str, bool, int | None, int]:
        return (self.model, self.stream, self.max_tokens, self.estimated_input_tokens)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, InferenceRequest):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"InferenceRequest(model={self.model!r}, stream={self.stream!r}, "
            f"max_tokens={self.max_tokens!r}, "
            f"estimated_input_tokens={self.estimated_input_tokens!r})"
        )


# Made on every request: not frozen, since a frozen dataclass's __init__ sets each field
# through object.__setattr__ (about 7x the cost). Hashed and compared by value like one;
# never assigned to after it is made.
@dataclass(slots=True, unsafe_hash=True)
class Admission:
    """One inference, admitted or not. Only an ALLOW admission is finished (and charged)."""

    verdict: Verdict
    route: str
    dialect: Dialect
    request: InferenceRequest | None = None
    decision: Decision | None = None
    message: str = ""  # for UNPRICED, and a DENY that never passes: what to tell the client
    never: Never | None = None  # a DENY that no wait ends
    # A hard limit's DENY that a smaller output cap per completion would pass now (fitting
    # is on): that cap, at least the configured minimum; None otherwise.
    fits: int | None = None

    @property
    def allowed(self) -> bool:
        return self.verdict is Verdict.ALLOW

    @property
    def lasts(self) -> tuple[Lasting, int]:
        """How long this refusal lasts, and the seconds of a wait."""
        verdict, decision = self.verdict, self.decision
        if verdict is Verdict.DENY:
            if self.never is Never.AS_SENT:
                return Lasting.AS_SENT, 0
            if self.never is Never.ANY or decision is None or decision.denied_limit is None:
                return Lasting.NEVER, 0  # a $0 limit, or the balance: it never resets
            return Lasting.WAIT, decision.retry_after or 0
        if verdict is Verdict.RATE_LIMITED:
            retry = None if decision is None else decision.retry_after
            return (Lasting.AS_SENT, 0) if retry is None else (Lasting.WAIT, retry)
        if verdict in (Verdict.UNPRICED, Verdict.MODEL_NOT_ALLOWED, Verdict.UNAUTHENTICATED):
            return Lasting.NEVER, 0
        return Lasting.OUTAGE, 0
