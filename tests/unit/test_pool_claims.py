"""What a worker process tells its supervisor (``pool.Recorder``), as the supervisor reads it
back from shared memory after the process died (``pool.Claims``): the job in hand and the failed
runs whose requeues wait for the batch, each counted as a lost run, and the successes whose acks
wait for it, acked by the supervisor."""

from __future__ import annotations

import multiprocessing
from datetime import timedelta

import pytest
from django.utils import timezone

from django_jobs.backends.base import Lease
from django_jobs.pool import ACKS_BYTES, CLAIMS_BYTES, Claims, Recorder, Shared


def shared() -> Shared:
    context = multiprocessing.get_context("fork")
    return Shared(context.Array("c", CLAIMS_BYTES, lock=False), context.Array("c", ACKS_BYTES, lock=False))


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


@pytest.mark.parametrize("told", ["unwritten", "succeeded"])
def test_a_run_of_another_claim_or_past_the_room_is_not_kept(told: str) -> None:
    """The recorder says ``False`` (of a failed run, or of a success): the batch then writes
    that requeue or ack at once."""
    memory = shared()
    recorder = Recorder(memory)
    tell = getattr(recorder, told)
    recorder.in_hand(lease("first"), True)
    assert not tell(lease("other", owner="p" * 32))
    kept = 0
    while tell(lease(f"{kept:032x}")):
        kept += 1
    assert kept >= 100  # PREFETCH's default fits
    claims = Claims.read(memory)
    assert claims is not None
    if told == "unwritten":
        assert len(claims.counted) == kept + 1
        recorder.in_hand(lease("f" * 32), True)  # room is kept for the job in hand
        claims = Claims.read(memory)
        assert claims is not None and claims.running == "f" * 32 and len(claims.counted) == kept + 1
    else:
        assert len(claims.succeeded) == kept and claims.succeeded[-1] == f"{kept - 1:032x}"


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


def test_the_successes_not_written_are_read_back_in_order_until_written() -> None:
    memory = shared()
    recorder = Recorder(memory)
    for token in ("a" * 32, "b" * 32, "c" * 32):
        recorder.in_hand(lease(token), True)
        assert recorder.succeeded(lease(token))
        recorder.in_hand(lease(token), False)
    claims = Claims.read(memory)
    assert claims is not None and claims.succeeded == ("a" * 32, "b" * 32, "c" * 32)
    assert claims.counted == []  # a success is acked, not counted as a lost run

    recorder.written([lease("a" * 32), lease("c" * 32)])
    claims = Claims.read(memory)
    assert claims is not None and claims.succeeded == ("b" * 32,)
    recorder.in_hand(lease("d"), True)
    assert recorder.succeeded(lease("d"))  # appended after what was left, not after the old end
    claims = Claims.read(memory)
    assert claims is not None and claims.succeeded == ("b" * 32, "d")

    recorder.written([lease("b" * 32), lease("d")])
    recorder.in_hand(lease("e"), True)
    assert recorder.succeeded(lease("e"))  # a shorter list over a longer one: read up to its end
    claims = Claims.read(memory)
    assert claims is not None and claims.succeeded == ("e",)
