"""The jobs bench/history_cost.py drains (a module of its own: workers import jobs by path)."""

from django_jobs import job

_failed: set[int] = set()


@job
def noop(n: int) -> int:
    """Returns its argument: the result a ``keep_result`` job keeps."""
    return n


@job
def flaky(n: int) -> int:
    """Fails its first attempt (in this process), then succeeds."""
    if n not in _failed:
        _failed.add(n)
        raise RuntimeError("first attempt fails")
    return n


@job
def stamp(sent: float) -> float:
    """Returns how long after ``sent`` (``time.time()`` at dispatch) it started."""
    import time

    return time.time() - sent
