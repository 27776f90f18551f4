"""What every system's no-op job shares: the Redis database and the completion timestamps.

The drain rate is computed from timestamps recorded by the jobs themselves, the same way for
every system: each no-op appends ``time.time()`` to the file named by ``BENCH_TS_FILE`` with one
unbuffered ``write(2)`` on an ``O_APPEND`` descriptor (a few microseconds, identical for all
systems, and correct across forks: RQ's forking worker runs each job in a fresh child).

With ``BENCH_COUNT_ROUNDTRIPS=1`` (the harness's probe, never its timed runs) redis-py is
instrumented in the worker process: every request sent (one command, or one whole pipeline) and
every reply read is counted, and each job writes the process's running totals (and its CPU
time, ``time.process_time()``: all its threads, user + system) next to its timestamp, so round
trips, commands and CPU per job come from the worker itself, between its first and last job,
whatever other clients do on the same server and however loaded the machine is.
"""

from __future__ import annotations

import os
import time

REDIS_HOST = os.environ.get("BENCH_REDIS_HOST", "127.0.0.1")
REDIS_PORT = int(os.environ.get("BENCH_REDIS_PORT", "6379"))
REDIS_DB = int(os.environ.get("BENCH_REDIS_DB", "12"))
REDIS_URL = f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}"
QUEUE = "default"

COUNT_ROUNDTRIPS = os.environ.get("BENCH_COUNT_ROUNDTRIPS") == "1"

_fd: int | None = None
_pid: int | None = None
_counts = [0, 0]  # requests sent (round trips), replies read (commands)


def _install_counters() -> None:
    from redis.connection import AbstractConnection

    send, read = AbstractConnection.send_packed_command, AbstractConnection.read_response
    if getattr(send, "_bench_counted", False):
        return

    def counted_send(self, *args, **kwargs):
        _counts[0] += 1
        return send(self, *args, **kwargs)

    def counted_read(self, *args, **kwargs):
        _counts[1] += 1
        return read(self, *args, **kwargs)

    counted_send._bench_counted = True  # type: ignore[attr-defined]
    AbstractConnection.send_packed_command = counted_send
    AbstractConnection.read_response = counted_read


if COUNT_ROUNDTRIPS:
    _install_counters()


def record() -> None:
    """The whole body of every no-op job: note when it ran."""
    global _fd, _pid
    if _fd is None or _pid != os.getpid():
        path = os.environ.get("BENCH_TS_FILE")
        if not path:
            return  # enqueue side or a manual run: nothing to record
        _fd, _pid = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), os.getpid()
    if COUNT_ROUNDTRIPS:
        os.write(_fd, b"%.6f %d %d %.6f\n" % (time.time(), _counts[0], _counts[1], time.process_time()))
    else:
        os.write(_fd, b"%.6f\n" % time.time())


def redis_client():
    import redis

    return redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=REDIS_DB)
