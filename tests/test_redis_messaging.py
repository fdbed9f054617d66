"""ops.redis_messaging: an event retried after a failure is published once; no trim
removes what a consumer group has not read.

On a real Redis (Debian's ``redis-server``; skipped, naming the package, where it is missing).
Faults are injected where a Redis restart or a dead API process puts them: a call that raises
``ConnectionError``. First prefect-redis's own publisher, shown losing the event (its
deduplication key written, the message not, the key never forgotten because Redis is gone), then
this module's, with the same faults, publishing it exactly once. Then the trim: prefect-redis's
shown removing messages a slower consumer group has not read, this module's keeping them.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import redis
from prefect_redis.client import clear_cached_clients, get_async_redis_client
from prefect_redis.messaging import _deduplication_key

from ops import redis_messaging


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def redis_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    program = shutil.which("redis-server")
    if program is None:
        pytest.skip("Debian's redis-server is not installed (`apt-get install redis-server`)")
    port = _free_port()
    server = subprocess.Popen(
        [program, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with redis.Redis(port=port) as client:
                    client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.05)
        monkeypatch.setenv("PREFECT_REDIS_MESSAGING_HOST", "127.0.0.1")
        monkeypatch.setenv("PREFECT_REDIS_MESSAGING_PORT", str(port))
        monkeypatch.setenv("PREFECT_REDIS_MESSAGING_DB", "0")
        yield port
    finally:
        server.terminate()
        server.wait(timeout=30)


def _stream_ids(port: int) -> list[str]:
    """The event ids in the `events` stream, in order."""
    import json

    with redis.Redis(port=port, decode_responses=True) as client:
        return [json.loads(fields["attributes"])["id"] for _, fields in client.xrange("events")]


def _publish(publisher_class: type[Any], event_id: str,
             faults: dict[str, Any] | None = None) -> str:
    """Publish one event (its id in the `id` attribute) as Prefect's API does, with each method
    named in faults replaced (by one that raises); return "ok" or the error's class name."""
    async def publish() -> str:
        await clear_cached_clients()
        cache = redis_messaging.Cache()
        try:
            with contextlib.ExitStack() as patches:
                for name, replacement in (faults or {}).items():
                    patches.enter_context(mock.patch(name, replacement))
                async with publisher_class("events", cache, deduplicate_by="id",
                                           batch_size=1) as publisher:
                    await publisher.publish_data(
                        f'{{"id": "{event_id}"}}'.encode(), {"id": event_id, "event": "t"})
            return "ok"
        except redis.ConnectionError as exc:
            return type(exc).__name__
        finally:
            await _close_clients()

    return asyncio.run(publish())


async def _close_clients() -> None:
    """Close this event loop's Redis client (prefect-redis keeps one a loop) and forget it."""
    await get_async_redis_client().aclose()
    await clear_cached_clients()


async def _gone(*args: Any, **kwargs: Any) -> Any:
    raise redis.ConnectionError("Connection closed by server.")


def test_prefect_redis_loses_an_event_retried_after_redis_went_away_between_its_two_steps(
        redis_port: int) -> None:
    from prefect_redis.messaging import Publisher as RedisPublisher

    event = str(uuid.uuid4())
    # Its deduplication key is written, then Redis goes: the XADD fails, and so does the
    # cleanup that would forget the key.
    first = _publish(RedisPublisher, event, {
        "redis.asyncio.client.Redis.xadd": _gone,
        "prefect_redis.messaging.Cache.forget_duplicates": _gone})
    assert first == "ConnectionError"  # the API answers 500; the client retries
    assert _publish(RedisPublisher, event) == "ok"  # answered 204 ...
    assert _stream_ids(redis_port) == []  # ... and never published: the event is lost


def test_an_event_retried_after_redis_went_away_is_published_once(redis_port: int) -> None:
    event = str(uuid.uuid4())
    # Redis gone before the script ran: nothing written, the retry publishes it.
    first = _publish(redis_messaging.Publisher, event,
                     {"redis.commands.core.AsyncScript.__call__": _gone})
    assert first == "ConnectionError"
    assert _stream_ids(redis_port) == []
    assert _publish(redis_messaging.Publisher, event) == "ok"
    assert _stream_ids(redis_port) == [event]
    # The reply lost after the script ran (or a client's retry of a 204): the retry finds both
    # written and publishes nothing more.
    assert _publish(redis_messaging.Publisher, event) == "ok"
    assert _stream_ids(redis_port) == [event]
    other = str(uuid.uuid4())
    assert _publish(redis_messaging.Publisher, other) == "ok"
    assert _stream_ids(redis_port) == [event, other]
    with redis.Redis(port=redis_port, decode_responses=True) as client:
        lifetime = client.ttl(_deduplication_key("messaging-cache", event))
    assert 0 < lifetime <= 300  # prefect-redis's 5 minutes of deduplication


def test_a_message_without_the_attribute_is_published_as_prefect_redis_does(
        redis_port: int, caplog: pytest.LogCaptureFixture) -> None:
    async def publish() -> None:
        await clear_cached_clients()
        async with redis_messaging.Publisher("events", redis_messaging.Cache(),
                                             deduplicate_by="id", batch_size=1) as publisher:
            await publisher.publish_data(b"{}", {"event": "t"})
        await _close_clients()

    asyncio.run(publish())
    with redis.Redis(port=redis_port, decode_responses=True) as client:
        assert client.xlen("events") == 1
    assert "without its deduplication attribute 'id'" in caplog.text


def test_the_broker_module_is_what_prefect_asks_of_one() -> None:
    from prefect.server.utilities.messaging import BrokerModule, CacheModule

    assert isinstance(redis_messaging, BrokerModule)
    assert isinstance(redis_messaging, CacheModule)


def _two_groups_apart(port: int, stream: str) -> None:
    """A stream of 16 messages in one millisecond (ids 1000-0 to 1000-15), its group `slow`
    having read up to 1000-3 and `fast` up to 1000-12, each with a consumer that is not idle."""
    with redis.Redis(port=port, decode_responses=True) as client:
        client.delete(stream)
        for sequence in range(16):
            client.xadd(stream, {"n": str(sequence)}, id=f"1000-{sequence}")
        for group, last in (("slow", "1000-3"), ("fast", "1000-12")):
            client.xgroup_create(stream, group, id=last)
            client.xgroup_createconsumer(stream, group, f"{group}-1")


def _unread_by_slow(port: int, stream: str) -> list[str]:
    with redis.Redis(port=port, decode_responses=True) as client:
        answer = client.xreadgroup("slow", "slow-1", {stream: ">"}, count=100)
    return [entry_id for _, entries in answer for entry_id, _ in entries]


def _trim(trim: Any, *args: Any) -> None:
    async def run() -> None:
        await clear_cached_clients()
        try:
            await trim(*args)
        finally:
            await _close_clients()

    asyncio.run(run())


def test_prefect_redis_trims_messages_a_slower_group_has_not_read(redis_port: int) -> None:
    from prefect_redis.messaging import _trim_stream_to_lowest_delivered_id

    _two_groups_apart(redis_port, "s")
    _trim(_trim_stream_to_lowest_delivered_id, "s")  # min() of the ids as text: "1000-12"
    # 1000-4 to 1000-11 are gone: the slow group never gets them.
    assert _unread_by_slow(redis_port, "s") == [f"1000-{n}" for n in range(12, 16)]


def test_the_trim_keeps_every_message_a_consumer_group_has_not_read(redis_port: int) -> None:
    _two_groups_apart(redis_port, "s")
    _trim(redis_messaging.trim_to_lowest_read, "s")
    with redis.Redis(port=redis_port, decode_responses=True) as client:
        assert client.xrange("s")[0][0] == "1000-3"  # what both groups read before it is gone
    assert _unread_by_slow(redis_port, "s") == [f"1000-{n}" for n in range(4, 16)]
    # The consumer trims through it (once its trim_every has passed), and a stream nothing
    # was published to is no error.
    _two_groups_apart(redis_port, "c")

    async def consume() -> None:
        await clear_cached_clients()
        consumer = redis_messaging.Consumer("c", trim_every=timedelta(0))
        consumer.stream = "c"
        try:
            await consumer._trim_stream_if_necessary()  # the first call starts its clock
            await asyncio.sleep(0.01)
            await consumer._trim_stream_if_necessary()
            await redis_messaging.trim_to_lowest_read("never-published")
        finally:
            await _close_clients()

    asyncio.run(consume())
    with redis.Redis(port=redis_port, decode_responses=True) as client:
        assert client.xrange("c")[0][0] == "1000-3"  # it trimmed, and only that far
    assert _unread_by_slow(redis_port, "c") == [f"1000-{n}" for n in range(4, 16)]
    assert redis_messaging.stream_id("1000-12") > redis_messaging.stream_id("1000-3")
