"""Huey: a ``RedisHuey`` (or ``PriorityRedisHuey`` with ``BENCH_HUEY_PRIORITY=1``), results off.

Consumer: ``python -m huey.bin.huey_consumer peers.huey_app.huey -w 1 -k thread``.
"""

import os

from huey import PriorityRedisHuey, RedisHuey

from peers.common import REDIS_DB, REDIS_HOST, REDIS_PORT, record

_cls = PriorityRedisHuey if os.environ.get("BENCH_HUEY_PRIORITY") == "1" else RedisHuey
huey = _cls("bench", host=REDIS_HOST, port=REDIS_PORT, db=REDIS_DB, results=False)


@huey.task()
def noop() -> None:
    record()
