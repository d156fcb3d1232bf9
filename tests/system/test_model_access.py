"""Model lists per key and per team, end to end through the official openai SDK: a model on
no list that applies is a 403 ``model_not_allowed`` before any counter is touched."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from spendguard.clock import utcnow
from spendguard.limits import Period
from spendguard.store import Store
from spendguard.store.memory import MemoryStore
from spendguard.store.redis import RedisStore
from tests.support import Gateway, call_cli, run_cli
from tests.support.processes import clean_env
from tests.testing.wire import openai_client

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> Store:
    if request.param == "memory":
        return MemoryStore()
    return RedisStore.from_url(request.getfixturevalue("redis_url"), timeout=2.0)


async def test_a_disallowed_model_is_a_403_through_the_openai_sdk(
    tmp_path: Path, store: Store
) -> None:
    async with Gateway(tmp_path, utcnow, store=store) as gw:
        await gw.policy(Period.DAY, 10**9)
        await gw.guard.admin.allow_models("acme", None, ["unit-*", "gpt-4o*"])  # the team
        await gw.guard.admin.allow_models("acme", "alpha", ["unit-model"])  # the key
        async with openai_client(gw.app) as client:
            ok = await client.chat.completions.create(
                model="unit-model", messages=[{"role": "user", "content": "hi"}]
            )
            assert ok.usage is not None
            with pytest.raises(openai.PermissionDeniedError) as denied:
                await client.chat.completions.create(
                    model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
                )
        error = denied.value.body
        assert isinstance(error, dict) and error["code"] == "model_not_allowed"
        assert "gpt-4o" in error["message"]
        await gw.settle()
        assert await gw.guard.ledger.unsettled() == (0, 0)
        assert await gw.guard.ledger.charges_total() == 15  # only the allowed one
        # Taking a model off the key's list applies at once in this process.
        await gw.guard.admin.allow_models("acme", "alpha", ["unit-model"], allowed=False)
        async with openai_client(gw.app) as client:
            ok = await client.chat.completions.create(  # only the team's list is left
                model="unit-model", messages=[{"role": "user", "content": "hi"}]
            )
            assert ok.usage is not None
    if isinstance(store, RedisStore):
        await store.aclose()


def test_cli_models_allow_rm_ls(tmp_path: Path) -> None:
    env = clean_env(SPENDGUARD_DATABASE_URL=f"sqlite:///{tmp_path / 'l.db'}")
    out = run_cli(env, "models", "allow", "--team", "acme", "--api-key", "k", "gpt-4o*", "o1")
    assert out["lists"] == {"k": ["gpt-4o*", "o1"]}
    # One real process above; the same command's other calls in process (call_cli).
    call_cli(env, "models", "allow", "--team", "acme", "claude-*")
    call_cli(env, "models", "rm", "--team", "acme", "--api-key", "k", "o1")
    assert call_cli(env, "models", "ls", "--team", "acme")["lists"] == {
        "": ["claude-*"],
        "k": ["gpt-4o*"],
    }
