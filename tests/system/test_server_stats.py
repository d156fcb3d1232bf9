"""The features benchmark's reading of the Redis servers' work (``benchmarks.features``).

A script's time already holds that of the commands it runs, which ``INFO commandstats`` books a
second time under their own names: the time read is the scripts' alone, the commands counted
are all of them. Runs on a private redis-server, whose counters no other test moves.
"""

from __future__ import annotations

from redis import Redis

from benchmarks.features import ServerStats
from tests.support import RedisServer

# One script making a hundred inner calls: its time is mostly theirs.
BUSY = "for i = 1, 100 do redis.call('HSET', KEYS[1], 'f' .. i, i) end return 1"


def test_a_scripts_inner_commands_are_counted_once_in_time_and_each_as_a_command() -> None:
    with RedisServer() as server:
        client = Redis.from_url(server.url)
        stats = ServerStats(server.url)
        try:
            sha = client.script_load(BUSY)
            usec_before, calls_before = stats.read()
            for _ in range(20):
                client.evalsha(sha, 1, "sg:stats")
            usec_after, calls_after = stats.read()
            info = client.info("commandstats")
        finally:
            stats.close()
            client.close()
    scripts = int(info["cmdstat_evalsha"]["usec"])
    inner = int(info["cmdstat_hset"]["usec"])
    assert inner > 0
    # Every script call ran after the first reading: the scripts' whole time, not theirs plus
    # their HSETs' again.
    assert usec_after - usec_before == scripts
    assert calls_after - calls_before == 20 * (1 + 100)
