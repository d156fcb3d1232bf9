"""The normalised values every other module produces: :class:`Usage`, :class:`Dialect`, and
the checks that turn untrusted response fields into them."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final

# Any real request is at most a few million tokens (the largest context windows are ~2M), so a
# count above this cannot be genuine: it is corruption or a hostile upstream. Such a usage is
# *not trusted* like any other malformed one, rather than clamped to the cap (clamping would
# bill a tenant thousands of dollars for one call and lock them out on a bug) or read as 0
# (which would serve an answer for free): the charge falls back to the estimate from the text.
_MAX_TOKENS: Final = 10**9
_MAX_MODEL_LEN: Final = 256


class Dialect(StrEnum):
    """The provider API format a route speaks (request, response and error bodies)."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"


# Made on every request: not frozen, since a frozen dataclass's __init__ sets each field
# through object.__setattr__ (about 7x the cost). Hashed and compared by value like one;
# never assigned to after it is made.
@dataclass(slots=True, unsafe_hash=True)
class Usage:
    """Token usage of one request, normalised across providers."""

    input_tokens: int = 0
    """Prompt tokens billed at the normal input price: excludes cache reads and cache writes."""
    output_tokens: int = 0
    """Completion/output tokens, reasoning included."""
    cached_input_tokens: int = 0
    """Cache reads (OpenAI ``cached_tokens``, Anthropic ``cache_read_input_tokens``)."""
    cache_write_tokens: int = 0
    """Cache writes (Anthropic ``cache_creation_input_tokens``)."""
    estimated: bool = False
    """True when spendguard estimated the counts instead of the provider reporting them."""

    @property
    def total_tokens(self) -> int:
        """Every token counted: input, output, cache reads and cache writes (what a TPM rate,
        a token budget and a provider key's TPM count)."""
        return (
            self.input_tokens + self.output_tokens + self.cached_input_tokens
        ) + self.cache_write_tokens


def estimate_usage(input_tokens: int, output_chars: int) -> Usage:
    """Usage to charge when the provider reported none: about 4 characters per output token."""
    return Usage(
        input_tokens=max(0, input_tokens),
        output_tokens=chars_to_tokens(output_chars),
        estimated=True,
    )


def chars_to_tokens(chars: int) -> int:
    """ceil(chars / 4) in integer arithmetic (no float rounding on huge counts)."""
    return -(-max(0, chars) // 4)


class InvalidCount(ValueError):
    """A count field holding what no provider sends: the usage object is not to be trusted."""


def token_count(value: object) -> int:
    """A token count from an untrusted field: absent or null reads as 0, anything else that is
    not a plausible count raises :class:`InvalidCount`.

    ``bool`` is an ``int`` subclass, hence the exact type check. Floats (even ``12.0``) and
    numeric strings are rejected: neither provider sends them, so they signal a broken upstream.
    """
    if value is None:
        return 0
    if type(value) is not int or value < 0 or value > _MAX_TOKENS:
        raise InvalidCount(repr(value)[:40])
    return value


def valid_model(value: object) -> str | None:
    """A model name from an untrusted field, or None if it isn't a plausible one."""
    # Same rules as a request's model: it may be used for pricing and lands in ledger rows.
    if (
        isinstance(value, str)
        and 0 < len(value) <= _MAX_MODEL_LEN
        and value.strip()
        and value.isprintable()
    ):
        return value
    return None
