"""What a worker process tells its supervisor (``pool.Recorder``), as the supervisor reads it
back from shared memory after the process died (``pool.Claims``): the job in hand and the failed
runs whose requeues wait for the batch, each counted as a lost run."""

from __future__ import annotations

import ctypes
import multiprocessing
from datetime import timedelta

from django.utils import timezone

from django_jobs.backends.base import Lease
from django_jobs.pool import CLAIMS_BYTES, Claims, Recorder


def shared() -> ctypes.Array[ctypes.c_char]:
    return multiprocessing.get_context("fork").Array("c", CLAIMS_BYTES, lock=False)


def lease(token: str, owner: str = "o" * 32, queue: str = "default") -> Lease:
    return Lease(token=token, owner_token=owner, expires_at=timezone.now() + timedelta(seconds=60), queue=queue)


def test_the_job_in_hand_and_the_failed_runs_not_written_are_counted() -> None:
    memory = shared()
    recorder = Recorder(memory)
    assert Claims.read(memory) is None
    recorder.in_hand(lease("a"), True)
    assert recorder.unwritten(lease("a"))
    recorder.in_hand(lease("a"), False)
    recorder.in_hand(lease("b"), True)
    assert recorder.unwritten(lease("b"))
    recorder.in_hand(lease("b"), False)
    recorder.in_hand(lease("c"), True)

    claims = Claims.read(memory)
    assert claims is not None
    assert (claims.queue, claims.owner, claims.running, claims.counted) == ("default", "o" * 32, "c", ["c", "a", "b"])

    recorder.written([lease("a")])
    recorder.in_hand(lease("c"), False)
    claims = Claims.read(memory)
    assert claims is not None and (claims.running, claims.counted) == (None, ["b"])


def test_a_failed_run_of_another_claim_or_past_the_room_is_not_kept() -> None:
    """The recorder says ``False``: the batch then writes that requeue at once."""
    memory = shared()
    recorder = Recorder(memory)
    recorder.in_hand(lease("first"), True)
    assert not recorder.unwritten(lease("other", owner="p" * 32))
    kept = 0
    while recorder.unwritten(lease(f"{kept:032x}")):
        kept += 1
    assert kept >= 100  # PREFETCH's default fits
    claims = Claims.read(memory)
    assert claims is not None and len(claims.counted) == kept + 1
    recorder.in_hand(lease("f" * 32), True)  # room is kept for the job in hand
    claims = Claims.read(memory)
    assert claims is not None and claims.running == "f" * 32 and len(claims.counted) == kept + 1


def test_a_queue_name_with_the_separator_or_a_colon_is_read_back_whole() -> None:
    memory = shared()
    recorder = Recorder(memory)
    queue = "odd\x1fqueue:" + "\U0001f600" * 3
    recorder.in_hand(lease("a", queue=queue), True)
    assert recorder.unwritten(lease("a", queue=queue))
    recorder.in_hand(lease("b", queue=queue), True)
    claims = Claims.read(memory)
    assert claims is not None
    assert (claims.queue, claims.owner, claims.running, claims.counted) == (queue, "o" * 32, "b", ["b", "a"])
