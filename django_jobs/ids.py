"""Job ids: time-ordered UUIDs (version 7, RFC 9562), as 32 lowercase hex characters.

An id starts with its Unix time in milliseconds, so ids sort in the order they were made: jobs
of equal priority and due time run in the order they were sent wherever a backend breaks ties
by id (the database backend's claim, Redis' delayed set). Within one process each id is greater
than the one before: 42 bits after the time count up from a random start each millisecond (RFC
9562's method 1, as Python 3.14's ``uuid.uuid7``), and a clock that goes back does not take
the ids back with it. The last 32 bits are random, so processes forked from one another, which
share the counter's state, still make distinct ids.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import UTC, datetime

_COUNTER_BITS = 42
_COUNTER_MAX = (1 << _COUNTER_BITS) - 1
_lock = threading.Lock()
_last_ms = 0
_counter = 0


def uuid7_hex() -> str:
    """A new UUIDv7 as 32 hex characters, greater than every earlier one of this process."""
    global _last_ms, _counter
    with _lock:
        now_ms = time.time_ns() // 1_000_000
        if now_ms > _last_ms:
            _last_ms = now_ms
            _counter = int.from_bytes(os.urandom(6)) >> 7  # 41 bits: room to count up
        elif _counter < _COUNTER_MAX:
            _counter += 1
        else:  # 2^41 ids in one millisecond: borrow the next one
            _last_ms += 1
            _counter = 0
        ms, counter = _last_ms, _counter
    value = (
        (ms & 0xFFFF_FFFF_FFFF) << 80
        | 0x7 << 76  # version 7
        | (counter >> 30) << 64  # rand_a: the counter's high 12 bits
        | 0b10 << 62  # the RFC 9562 variant
        | (counter & 0x3FFF_FFFF) << 32  # the counter's low 30 bits
        | int.from_bytes(os.urandom(4))
    )
    return f"{value:032x}"


def time_of(job_id: str) -> datetime | None:
    """When the job ``job_id`` was made, from its id (its dispatch, to the millisecond); ``None``
    for an id that is not a UUIDv7 (jobs sent by earlier versions, ids chosen by hand)."""
    seconds = seconds_of(job_id)
    if seconds is None:
        return None
    try:
        return datetime.fromtimestamp(seconds, tz=UTC)
    except (ValueError, OverflowError, OSError):
        return None


def seconds_of(job_id: str) -> float | None:
    """:func:`time_of` as epoch seconds (what the worker's wait metric needs, without a datetime)."""
    if len(job_id) != 32 or job_id[12] != "7" or job_id[16] not in "89ab":
        return None
    try:
        return int(job_id[:12], 16) / 1000
    except ValueError:
        return None


def short(job_id: str) -> str:
    """What a list shows of a job id: its last 8 characters. An id's head is its time, the same
    for every job sent within a minute or so; its tail is the counter and random bits."""
    return job_id[-8:]


def _after_fork() -> None:
    """A child forked while another thread held the lock would wait for it for ever."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)
