"""The budgets tests' stores: every gateway-level budget test that takes ``storage`` runs on
the in-process store, a real redis-server and a real 3-master Cluster."""

from __future__ import annotations

import uuid

import pytest

from tests.support import RedisCluster


@pytest.fixture(params=["memory", "redis", "cluster"])
def storage(request: pytest.FixtureRequest) -> dict[str, object]:
    """Settings for a BudgetGateway: none (memory), or the Redis URL with a prefix of the
    test's own (the session's servers are shared)."""
    if request.param == "memory":
        return {}
    if request.param == "redis":
        url: str = request.getfixturevalue("redis_url")
    else:
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        url = cluster.url
    return {"redis_url": url, "key_prefix": f"b{uuid.uuid4().hex[:8]}", "redis_timeout": 2.0}
