"""Enqueue side of ``bench/redis_peers.py``, one system per process.

    python -m peers.driver enqueue --system djjobs|rq|huey|huey-prio|dramatiq|raw --mode single|bulk --n N

Prints one JSON object (``seconds`` of the timed loop, ``queued`` as the broker reports it).
Only the enqueue loop is timed: imports, Django set-up and the first connection are not
(each system's client is connected before the clock starts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

BULK = {"djjobs", "rq", "raw"}  # systems with a batch enqueue API


def enqueue_djjobs(n: int, mode: str) -> dict:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "peers.settings")
    import django

    django.setup()
    from django_jobs import Jobs
    from peers.djjobs_tasks import noop

    backend = Jobs.backend()
    backend.client.ping()  # connect and register the scripts before timing
    t0 = time.perf_counter()
    if mode == "bulk":
        Jobs.bulk([noop.builder() for _ in range(n)])
    else:
        for _ in range(n):
            noop.dispatch()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "queued": backend.size("default")}


def enqueue_rq(n: int, mode: str) -> dict:
    from rq import Queue

    from peers.common import QUEUE, redis_client
    from peers.rq_tasks import noop

    client = redis_client()
    client.ping()
    queue = Queue(QUEUE, connection=client)
    t0 = time.perf_counter()
    if mode == "bulk":
        queue.enqueue_many([Queue.prepare_data(noop) for _ in range(n)])
    else:
        for _ in range(n):
            queue.enqueue(noop)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "queued": queue.count}


def enqueue_huey(n: int, mode: str) -> dict:
    from peers.huey_app import huey, noop

    huey.storage.conn.ping()
    t0 = time.perf_counter()
    for _ in range(n):
        noop()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "queued": huey.pending_count()}


def enqueue_dramatiq(n: int, mode: str) -> dict:
    from peers.dramatiq_app import broker, noop

    broker.client.ping()
    t0 = time.perf_counter()
    for _ in range(n):
        noop.send()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "queued": broker.client.hlen("bench_dramatiq:default.msgs")}


def enqueue_raw(n: int, mode: str) -> dict:
    from peers import raw

    if mode == "bulk":
        import json as _json
        import uuid

        client = raw.redis_client()
        client.ping()
        t0 = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for _ in range(n):
            job_id = uuid.uuid4().hex
            pipe.hset(raw.BODIES, job_id, _json.dumps({"id": job_id, "handler": "noop", "args": [], "kwargs": {}}))
            pipe.lpush(raw.WAITING, job_id)
        pipe.execute()
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "queued": client.llen(raw.WAITING)}
    return raw.enqueue(n)


ENQUEUE = {
    "djjobs": enqueue_djjobs,
    "rq": enqueue_rq,
    "rq-fork": enqueue_rq,
    "huey": enqueue_huey,
    "huey-prio": enqueue_huey,
    "dramatiq": enqueue_dramatiq,
    "raw": enqueue_raw,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("enqueue")
    e.add_argument("--system", choices=sorted(ENQUEUE), required=True)
    e.add_argument("--mode", choices=["single", "bulk"], default="single")
    e.add_argument("--n", type=int, required=True)
    args = parser.parse_args()
    if args.system == "huey-prio":
        os.environ["BENCH_HUEY_PRIORITY"] = "1"
    if args.mode == "bulk" and args.system.split("-")[0] not in BULK:
        raise SystemExit(f"{args.system} has no bulk enqueue")
    result = ENQUEUE[args.system](args.n, args.mode)
    result["mode"] = args.mode
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
