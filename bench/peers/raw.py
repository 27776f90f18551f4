"""The physical floor: a plain redis-py loop doing the reliable-queue steps of django-jobs.

Per job, in one process, two round trips, the minimum for a queue that acknowledges each job
without prefetching:

1. ``FETCH`` (one Lua script): pop the oldest id from the waiting list, add it to the processing
   zset with its lease deadline as score (so a reaper could find it after a crash), return the
   id and its body;
2. decode the JSON body, look the handler up in a dict and call the no-op;
3. ack: ``ZREM`` from processing and ``HDEL`` the body in one ``MULTI``/``EXEC``.

Not done, on purpose (this is the floor, not a product): no signature, no owner token
(fencing), no priorities, no retries, no metrics, no reaper, no per-job output.

    python -m peers.raw enqueue --n N      # prints {"seconds": ...}
    python -m peers.raw work --n N         # drains N jobs, then exits
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid

from peers.common import QUEUE, record, redis_client

WAITING, PROCESSING, BODIES = (f"bench_raw:{QUEUE}:{kind}" for kind in ("waiting", "processing", "bodies"))
LEASE_SECONDS = 60

FETCH = """
local id = redis.call('RPOP', KEYS[1])
if not id then return false end
redis.call('ZADD', KEYS[2], ARGV[1], id)
return {id, redis.call('HGET', KEYS[3], id)}
"""


def noop() -> None:
    record()


HANDLERS = {"noop": noop}


def enqueue(n: int) -> dict:
    client = redis_client()
    client.ping()
    t0 = time.perf_counter()
    for _ in range(n):
        job_id = uuid.uuid4().hex
        body = json.dumps({"id": job_id, "handler": "noop", "args": [], "kwargs": {}})
        pipe = client.pipeline(transaction=True)  # MULTI HSET LPUSH EXEC: one round trip
        pipe.hset(BODIES, job_id, body)
        pipe.lpush(WAITING, job_id)
        pipe.execute()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "queued": client.llen(WAITING)}


def work(n: int) -> dict:
    client = redis_client()
    fetch = client.register_script(FETCH)
    done = 0
    while done < n:
        got = fetch(keys=[WAITING, PROCESSING, BODIES], args=[int((time.time() + LEASE_SECONDS) * 1000)])
        if got is None:
            break  # burst mode: the queue is empty
        job_id, body = got
        message = json.loads(body)
        HANDLERS[message["handler"]](*message["args"], **message["kwargs"])
        pipe = client.pipeline(transaction=True)
        pipe.zrem(PROCESSING, job_id)
        pipe.hdel(BODIES, job_id)
        pipe.execute()
        done += 1
    return {"done": done}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cmd", choices=["enqueue", "work"])
    parser.add_argument("--n", type=int, required=True)
    args = parser.parse_args()
    result = enqueue(args.n) if args.cmd == "enqueue" else work(args.n)
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
