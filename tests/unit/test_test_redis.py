"""The suite's own Redis (llmesh.testing.TestRedis): a database per user, flushed when handed out,
reused once given back; the embedded server it starts wants its password."""

from __future__ import annotations

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from llmesh.testing import TestRedis


def test_each_user_gets_its_own_flushed_database(redis_server: TestRedis) -> None:
    with redis_server.held() as one, redis_server.held() as two:
        assert one != two
        with redis.Redis.from_url(one) as a, redis.Redis.from_url(two) as b:
            a.set("mine", "1")
            assert b.get("mine") is None
    taken = []
    for _ in range(redis_server.databases):  # every database once more: the two above come back flushed
        url = redis_server.database()
        taken.append(url)
        with redis.Redis.from_url(url) as client:
            assert client.dbsize() == 0
    assert one in taken
    for url in taken:
        redis_server.release(url)


def test_the_embedded_test_server_has_a_password(redis_server: TestRedis) -> None:
    if redis_server.server is None:
        pytest.skip("LLMESH_TEST_REDIS_URL names the server: its password is its own business")
    assert redis_server.password
    once = Retry(NoBackoff(), 0)
    with redis.Redis(host=redis_server.host, port=redis_server.port, retry=once) as anonymous:
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
