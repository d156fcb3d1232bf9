"""3. Overshoot: N requests in flight together against a key whose remaining budget covers k.

spendguard's limits are soft (README, "Soft limits"): a request is admitted while usage is
below the limit and charged when it ends, so requests admitted together all finish. This
measures how far that goes over HTTP, on the gateway servers of section 2.

Per trial: a fresh team and key get a daily key limit of (k + 1) requests' cost; one request
warms the caches (policy loaded, usage keys filled) and spends one request's worth, so the
remaining budget covers exactly k requests. Then N connections are opened and one request is
sent on each at the same moment. Reported: requests admitted, and the period's spend as a
multiple of the limit (1.0 = held exactly).

The same burst runs against a hard limit (README, "Hard limits"), whose remaining budget after
the warm-up covers exactly k requests' worst case: at most k are in flight at once, and the
spend can't pass the limit (a request that ends early gives back the rest of its hold, so the
burst's later requests may use it: more than k can be admitted in all).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from collections.abc import Callable
from typing import Any

from spendguard import Identity
from spendguard.asgi.request import parse_request
from spendguard.engine.costing import Coster
from spendguard.engine.entries import worst_case
from spendguard.engine.pricing import PriceTable
from spendguard.settings import UnknownModel
from spendguard.testing import expected_usage

from .apps import INFERENCE_PATH, MODEL, chat_body, overshoot_team, overshoot_token
from .common import Sizes, set_policies
from .loadgen import Target, run_burst
from .services import GatewayServer
from .stats import summary

VARIANTS = ("embedded", "redis")  # the peer counts requests, not spend: no overshoot to compare
# Each variant with soft limits, then with hard ones ("redis/hard").
LABELLED = (*VARIANTS, *(f"{v}/hard" for v in VARIANTS))


def budget_requests(n: int) -> int:
    """k: how many requests the remaining budget covers for a burst of n."""
    return max(1, n // 10)


def worst_cost() -> int:
    """What a hard limit holds for one benchmark request (its worst case)."""
    coster = Coster(PriceTable.load(None), UnknownModel.DEFAULT_PRICE)
    return worst_case(parse_request(chat_body()), coster)


def request_cost() -> int:
    """Micro-USD one benchmark request costs: the fake provider's usage at the shipped price."""
    coster = Coster(PriceTable.load(None), UnknownModel.DEFAULT_PRICE)
    return coster.cost(MODEL, expected_usage(INFERENCE_PATH, json.loads(chat_body())))


def _post(server: GatewayServer, token: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request(
            "POST",
            INFERENCE_PATH,
            body=chat_body(),
            headers={"authorization": f"Bearer {token}", "content-type": "application/json"},
        )
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def measure(
    servers: dict[str, GatewayServer],
    database_urls: dict[str, str],
    sizes: Sizes,
    repeats: int,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    cost, worst = request_cost(), worst_cost()
    trial = 0
    raw: dict[tuple[str, int], list[dict[str, float]]] = {}
    for n in sizes.overshoot_n:
        k = budget_requests(n)
        progress(f"overshoot: N={n}, budget for k={k}")
        for _ in range(repeats):
            for label in LABELLED:
                v, _, mode = label.partition("/")
                server = servers[v]
                token = overshoot_token(trial)
                identity = Identity(overshoot_team(trial), "k")
                trial += 1
                hard = mode == "hard"
                limit = cost + k * worst if hard else (k + 1) * cost
                asyncio.run(
                    set_policies(
                        database_urls[v], identity, key_day=limit, team_month=None, hard=hard
                    )
                )
                if (status := _post(server, token)) != 200:
                    raise RuntimeError(f"overshoot warm-up request answered {status}")
                time.sleep(0.1)  # its postflight runs after the response: let it land
                target = Target(
                    server.base + INFERENCE_PATH,
                    "POST",
                    chat_body(),
                    (("authorization", f"Bearer {token}"), ("content-type", "application/json")),
                )
                statuses = run_burst(target, n)
                admitted = statuses.get("200", 0)
                refused, unavailable = statuses.get("429", 0), statuses.get("503", 0)
                raw.setdefault((label, n), []).append(
                    {
                        "admitted": admitted,
                        "refused": refused,
                        "unavailable": unavailable,  # 503: the store call timed out
                        "other": n - admitted - refused - unavailable,
                        "spend_over_limit": (1 + admitted) * cost / limit,
                    }
                )
    out: dict[str, Any] = {"request_cost_micros": cost, "worst_case_micros": worst, "variants": {}}
    for label in LABELLED:
        per_n: dict[str, Any] = {}
        for n in sizes.overshoot_n:
            trials = raw[(label, n)]
            per_n[str(n)] = {
                "n": n,
                "k": budget_requests(n),
                **{
                    field: summary([t[field] for t in trials])
                    for field in (
                        "admitted",
                        "refused",
                        "unavailable",
                        "other",
                        "spend_over_limit",
                    )
                },
            }
        out["variants"][label] = per_n
    return out
