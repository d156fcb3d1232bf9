"""A fake OpenAI/Anthropic-compatible upstream provider (ASGI app) for tests, demo, benchmarks.

It answers the five routes a spendguard gateway proxies, in the providers' real wire formats
(checked against recorded bodies and against the official ``openai`` and ``anthropic`` SDKs):

* ``POST /v1/chat/completions``: ``chat.completion``, or ``chat.completion.chunk`` SSE ending
  in ``data: [DONE]`` (usage chunk only with ``stream_options.include_usage``);
* ``POST /v1/completions``: legacy ``text_completion``, JSON or SSE ending in ``[DONE]``;
* ``POST /v1/responses``: a Responses API object, or ``response.*`` events;
* ``POST /v1/embeddings``: a ``list`` of embeddings, float or base64;
* ``POST /v1/messages``: an Anthropic ``message``, or ``message_start`` ... ``message_stop``.

Everything a test needs to predict is deterministic and computable from the request alone, so a
test can assert the exact micro-USD a gateway charged (:func:`expected_usage`):

* input tokens = ceil(units / 4), at least 1, where units counts the characters of every string
  in the prompt-bearing fields of the body (messages, prompt, input, instructions, system,
  tools...) plus 4 per integer (token-id arrays);
* the answer is ``chunks`` words ``"tok0 tok1 ..."``, one content delta per word, cut short at
  the request's own max-tokens field like a real model (then finish reason ``length`` /
  ``max_tokens`` / ``incomplete``); output tokens = ``output_tokens`` if given, else the number
  of words;
* no prompt caching: cached and cache-write counts are always 0.

Failure modes, per app or per request through ``x-fake-*`` headers (see :func:`fake_upstream`),
let tests drive the gateway's error paths: provider error envelopes, missing usage, streams that
stall forever and streams that are cut off mid-body.

:class:`StreamingASGITransport` lets an httpx client reach the app (or any ASGI app) in process
with real streaming and disconnects.

Where things are: :mod:`.upstream` (the app), :mod:`.options` (``x-fake-*`` overrides),
:mod:`.tokens` (the token rule), :mod:`.scripts` (one wire format per endpoint),
:mod:`.framing` (JSON and SSE framing), :mod:`.error_responses` (error envelopes),
:mod:`.playback` (stalls and aborts), :mod:`.routes`, :mod:`.transport`.
"""

from .playback import UpstreamAborted
from .routes import ROUTES
from .tokens import expected_text, expected_usage
from .transport import StreamingASGITransport
from .upstream import FakeUpstream, ReceivedRequest, fake_upstream

__all__ = [
    "ROUTES",
    "FakeUpstream",
    "ReceivedRequest",
    "StreamingASGITransport",
    "UpstreamAborted",
    "expected_text",
    "expected_usage",
    "fake_upstream",
]
