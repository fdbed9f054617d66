"""prefect-redis's message broker with two changes: a deduplicated message is published once,
and a stream is never trimmed past a message a consumer group has not read.

The scaled layout (``scripts/scaled.py``, docs/scaled.md) names this module as Prefect's
``PREFECT_MESSAGING_BROKER``; everything but the publisher and the consumer's trim is
prefect-redis's own.

Why. prefect-redis (0.3.0) publishes an event in two steps: ``SET NX`` of the event id's
deduplication key (kept 5 minutes), then ``XADD`` to the stream. When Redis goes away between
the two (a restart) or the API process dies between them, the key stays and the message is
not in the stream; the client's retry of the same event (same id) is then taken for a
duplicate: answered 204, never stored (``tests/test_redis_messaging.py`` shows the two steps
apart, live).

The change. One Lua script does both, atomically on the server: if the key exists the
message was published (nothing to do); else ``XADD``, then ``SET`` of the key. A retry after
any failure (a lost reply, a dead process, a restart) finds either both done or neither. A
script that fails halfway (``XADD`` done, ``SET`` not: only a server out of memory) leaves a
duplicate, never a loss; Prefect's event store keeps one row per event id.

On a Redis Cluster the stream and the key live in different slots, which one script cannot
write: the publisher then does what prefect-redis does, and says so once.

The trim. A consumer trims its stream now and then to the lowest id its consumer groups have
read (``XTRIM MINID``). prefect-redis (0.3.0) takes that lowest id with ``min()`` of the ids
as text, so ``1000-12`` comes before ``1000-3``: with ten or more messages in one millisecond
and one group behind another, it trims messages the slower group has not read yet, and that
group never sees them (``tests/test_redis_messaging.py`` shows it). :class:`Consumer` trims
to the lowest id as Redis orders them (milliseconds, then sequence); the rest is prefect-redis's:
groups that read nothing yet, and groups whose consumers are all idle past
``trim_idle_threshold``, do not hold the trim back.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
from prefect_redis.client import get_async_redis_client
from prefect_redis.messaging import (
    MESSAGE_DEDUPLICATION_LOOKBACK,
    Cache,
    RedisMessagingConsumerSettings,
    RedisStreamsMessage,
    _cleanup_empty_consumer_groups,
    _deduplication_key,
    _is_missing_stream_error,
    break_topic,
    ephemeral_subscription,
)
from prefect_redis.messaging import Consumer as RedisConsumer
from prefect_redis.messaging import Publisher as RedisPublisher
from redis.exceptions import ResponseError

__all__ = ["PUBLISH_ONCE", "Cache", "Consumer", "Publisher", "break_topic",
           "ephemeral_subscription"]

log = logging.getLogger(__name__)

PUBLISH_ONCE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return false
end
local id = redis.call('XADD', KEYS[2], '*', 'data', ARGV[1], 'attributes', ARGV[2])
redis.call('SET', KEYS[1], '1', 'EX', ARGV[3])
return id
"""
"""KEYS: the deduplication key, the stream. ARGV: the message's data, its attributes (JSON),
the key's lifetime in seconds. Returns the stream entry's id, or false for a duplicate."""

_said_cluster = False


class Publisher(RedisPublisher):  # type: ignore[misc]  # prefect-redis ships no types
    """prefect-redis's publisher whose deduplicated messages go out through PUBLISH_ONCE."""

    async def _publish_current_batch(self) -> None:
        if not self._batch or not self.deduplicate_by:
            await super()._publish_current_batch()
            return
        topic = getattr(self.cache, "topic", "messaging-cache")
        if _deduplication_key(topic, "").startswith("{"):
            _say_cluster()
            await super()._publish_current_batch()
            return
        batch = list(self._batch)
        # Cleared first, as prefect-redis does: its __aexit__ forgets the keys of what is still
        # in the batch when a publish fails, and a key this script wrote must never be forgotten.
        self._batch.clear()
        once = self._client.register_script(PUBLISH_ONCE)
        lifetime = int(MESSAGE_DEDUPLICATION_LOOKBACK.total_seconds())
        for message in batch:
            await self._publish(message, once, topic, lifetime)

    async def _publish(self, message: RedisStreamsMessage, once: Any, topic: str,
                       lifetime: int) -> None:
        attributes = message.attributes or {}
        fields = {"data": message.data, "attributes": orjson.dumps(attributes)}
        value = attributes.get(self.deduplicate_by)  # set: the batch went through the script
        if value is None:  # prefect-redis publishes these undeduplicated, with a warning
            log.warning("message without its deduplication attribute %r; published as it is",
                        self.deduplicate_by)
            await self._client.xadd(self.stream, fields)
            return
        await once(keys=[_deduplication_key(topic, value), self.stream],
                   args=[fields["data"], fields["attributes"], lifetime])


def _say_cluster() -> None:
    global _said_cluster
    if not _said_cluster:
        _said_cluster = True
        log.warning("Redis Cluster: events are deduplicated as prefect-redis does (two steps; "
                    "an event retried after a failure between them can be lost)")


def stream_id(text: str) -> tuple[int, int]:
    """Return a stream entry id (``<milliseconds>-<sequence>``) as Redis orders it."""
    milliseconds, _, sequence = text.partition("-")
    return int(milliseconds), int(sequence or 0)


class Consumer(RedisConsumer):  # type: ignore[misc]  # prefect-redis ships no types
    """prefect-redis's consumer whose trim keeps what a consumer group has not read."""

    _last_trimmed: float | None  # set by prefect-redis's constructor

    async def _trim_stream_if_necessary(self, latest_delivered_id: str | None = None) -> None:
        now = time.monotonic()
        if self._last_trimmed is None:
            self._last_trimmed = now
        if now - self._last_trimmed > self.trim_every.total_seconds():
            await trim_to_lowest_read(self.stream, latest_delivered_id)
            await _cleanup_empty_consumer_groups(self.stream)
            self._last_trimmed = now


async def trim_to_lowest_read(stream: str, latest_read: str | None = None) -> None:
    """Trim stream to the lowest id its active consumer groups (and a reader outside a group,
    ``latest_read``) have read: every message before it was read by all of them."""
    client = get_async_redis_client()
    idle_ms = RedisMessagingConsumerSettings().trim_idle_threshold.total_seconds() * 1000
    read = [latest_read] if latest_read and latest_read != "0-0" else []
    try:
        groups = await client.xinfo_groups(stream)
    except ResponseError as exc:
        if _is_missing_stream_error(exc):
            return  # nothing published to it yet
        raise
    for group in groups:
        last = group["last-delivered-id"]
        if last != "0-0" and not await _all_idle(stream, group["name"], idle_ms):
            read.append(last)
    if read:
        await client.xtrim(stream, minid=min(read, key=stream_id), approximate=False)


async def _all_idle(stream: str, group: str, idle_ms: float) -> bool:
    """Whether every consumer of group has been idle past idle_ms (it then holds nothing
    back); False when that cannot be read, so the group counts."""
    try:
        consumers = await get_async_redis_client().xinfo_consumers(stream, group)
    except Exception as exc:
        log.debug("the consumers of %s on %s could not be read: %r", group, stream, exc)
        return False
    return bool(consumers) and all(consumer["idle"] > idle_ms for consumer in consumers)
