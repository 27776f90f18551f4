"""Dramatiq: ``RedisBroker`` with its default middleware (no result backend).

Worker: ``python -m dramatiq peers.dramatiq_app --processes 1 --threads 1``.
"""

import dramatiq
from dramatiq.brokers.redis import RedisBroker

from peers.common import REDIS_URL, record

broker = RedisBroker(url=REDIS_URL, namespace="bench_dramatiq")
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name="default")
def noop() -> None:
    record()
