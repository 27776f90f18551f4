"""RQ: the no-op job function (RQ imports it by dotted path in the worker)."""

from peers.common import record


def noop() -> None:
    record()
