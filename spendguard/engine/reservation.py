"""What a request reserves for its output before the provider is called (design.md, "What a
request reserves").

Hard spend limits, TPM rates and token budgets all hold a request's worst case while it runs,
and they must agree on it, so there is one rule, :meth:`OutputReservation.per_completion`:

- the output cap the request declares (``max_tokens``, ``max_completion_tokens`` or
  ``max_output_tokens``, the largest when several are sent), or, without one, the default
  (``SPENDGUARD_DEFAULT_OUTPUT_TOKENS``, per model ``SPENDGUARD_DEFAULT_OUTPUT_TOKENS_BY_MODEL``);
- capped at the most the model can produce, where the price table knows it: a reservation
  beyond what the provider would ever serve refuses requests that cannot cost that much.

Each of the ``n`` completions a request asks for is reserved (each is billed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Final

from ..money import micros_to_usd

if TYPE_CHECKING:
    from .decision import InferenceRequest
    from .pricing import PriceTable

# About one long answer: what a request that sets no output cap is assumed to ask for.
DEFAULT_OUTPUT_TOKENS: Final = 4096


@dataclass(frozen=True, slots=True)
class OutputReservation:
    """The output reserved for a request that declares no cap: ``default``, or the model's
    own in ``by_model`` (names as the client sends them or as the price table's entry,
    case-insensitive)."""

    default: int = DEFAULT_OUTPUT_TOKENS
    by_model: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, default: int, by_model: Mapping[str, int]) -> OutputReservation:
        return cls(default, MappingProxyType({k.strip().lower(): v for k, v in by_model.items()}))

    def default_for(self, model: str, table: PriceTable | None, default: int | None = None) -> int:
        """The output reserved for ``model`` when a request sets no cap (before the model's
        maximum caps it). ``default`` replaces :attr:`default` (a budgets section's own)."""
        by_model = self.by_model
        if by_model:  # most setups set none: no lookup then
            own = by_model.get(model.strip().lower())
            if own is None and table is not None:
                entry = table.resolve(model)
                own = None if entry is None else by_model.get(entry)
            if own is not None:
                return own
        return self.default if default is None else default

    def per_completion(
        self, request: InferenceRequest, table: PriceTable | None, default: int | None = None
    ) -> int:
        """The output tokens reserved for each completion of ``request``."""
        output = request.max_tokens
        if output is None:
            output = self.default_for(request.model, table, default)
        most = None if table is None else table.max_output_tokens(request.model)
        return output if most is None or output <= most else most

    def tokens(
        self, request: InferenceRequest, table: PriceTable | None, default: int | None = None
    ) -> int:
        """The output tokens reserved for ``request``: each of its completions'."""
        return self.per_completion(request, table, default) * request.choices


DEFAULT_RESERVATION: Final = OutputReservation()


def describe_output(request: InferenceRequest, output: int, table: PriceTable | None) -> str:
    """Where a reservation's ``output`` tokens come from, for a refusal's message."""
    each = f" for each of its {request.choices} completions" if request.choices > 1 else ""
    per = output // request.choices if request.choices > 1 else output
    most = None if table is None else table.max_output_tokens(request.model)
    if request.max_tokens is None:
        why = "it sets no max_tokens, so the default output reservation applies"
    elif most is not None and request.max_tokens > most:
        why = f"its max_tokens of {request.max_tokens:,}, capped at the model's maximum output"
    else:
        why = "its max_tokens"
    return f"{per:,} output tokens{each} ({why})"


def advice(request: InferenceRequest, fitting: int) -> str:
    """What to change so the request fits: ``fitting`` is the largest output cap per
    completion that would (below 1: none, the input alone is too large)."""
    if fitting < 1:
        return "Its input alone does not fit: shorten the prompt."
    verb = "Set" if request.max_tokens is None else "Lower"
    return f"{verb} max_tokens to at most {fitting:,}."


def largest_fitting(cost_of: Callable[[int], int], limit: int, cap: int) -> int:
    """The largest output per completion in 0..``cap`` whose reservation ``cost_of`` is at
    most ``limit``; -1 when not even no output fits. ``cost_of`` grows with its argument
    (prices and tiers only add), so a binary search finds it: a refusal's message, never
    the path of an admitted request."""
    if cost_of(0) > limit:
        return -1
    low, high = 0, cap  # cost_of(low) fits; the answer is in low..high
    while low < high:
        mid = (low + high + 1) // 2
        if cost_of(mid) <= limit:
            low = mid
        else:
            high = mid - 1
    return low


def usd(micros: int) -> str:
    """Micro-USD for a message: ``$0.004145``, ``$5.00``."""
    whole, _, cents = str(micros_to_usd(micros)).partition(".")
    return f"${whole}.{cents.rstrip('0').ljust(2, '0')}"
