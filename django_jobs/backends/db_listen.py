"""PostgreSQL wake-ups: an idle worker ``LISTEN``s for the ``NOTIFY django_jobs`` that a trigger
sends when jobs are inserted (migration ``0003_notify_trigger``).

A ``LISTEN`` belongs to a server session. A pooler in transaction mode (PgBouncer's
``pool_mode = transaction``) hands each transaction whichever server session is free, so a
``LISTEN`` sent through it is not held: the notifications go to a session the worker no longer
has. Before its first ``LISTEN`` on a database (``jobs_work`` asks at its start), a process
finds out: it listens on a channel of its own and has a ``NOTIFY`` sent there through the
queue's database. A session held delivers
it at once; a pooled one never does, and idle workers then poll. ``OPTIONS["LISTEN_DATABASE"]``
names a direct connection (a database alias) to listen on instead.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from typing import Any

from django.db import connections

from .. import conf

CHANNEL = "django_jobs"
NO_WAIT = 0.001  # seconds: a listener's shortest wait for notifications
PROBE_WAIT = 1.0  # seconds a probe's NOTIFY may take to arrive on a session that is held
logger = logging.getLogger("django_jobs.backends.database")
# (listening alias, queue alias) -> whether a LISTEN there is held: found out once a process.
_HELD: dict[tuple[str, str], bool] = {}


def address(alias: str) -> str:
    """``alias (host:port)`` of a database alias, for messages; never connects."""
    db = connections[alias].settings_dict
    return f"{alias!r} ({db.get('HOST') or 'localhost'}:{db.get('PORT') or 'default port'})"


class Listener:
    """The connection an idle worker of one backend ``LISTEN``s on (one per backend instance,
    opened at its first wait, closed after an error and opened again at the next wait)."""

    def __init__(self, backend: str, alias: str, queue_alias: str) -> None:
        self.backend, self.alias, self.queue_alias = backend, alias, queue_alias
        self.connection: Any = None

    def wait(self, timeout: float) -> bool:
        """Block until a job is inserted or ``timeout`` passes; ``False`` at once when a
        ``LISTEN`` is not held here (the worker polls)."""
        try:
            listener = self._listening()
            if listener is None:
                return False
            # (psycopg waits without end for a timeout of 0: the shortest wait is a millisecond.
            # Each notifies() holds the connection's lock until it ends: one at a time.)
            if list(listener.notifies(timeout=max(timeout, NO_WAIT), stop_after=1)):
                # Notifications queued while the worker was busy: one fetch serves them all.
                list(listener.notifies(timeout=NO_WAIT))
        except Exception:
            self.close()
            raise
        return True

    def close(self) -> None:
        connection, self.connection = self.connection, None
        if connection is not None:
            with contextlib.suppress(Exception):  # it may be broken already
                connection.close()

    def held(self) -> bool:
        """Is a ``LISTEN`` held on this database? Found out once a process (``_probe``)."""
        key = (self.alias, self.queue_alias)
        if key not in _HELD:
            connection = _connect(self.alias)
            try:
                _HELD[key] = self._probe(connection)
            finally:
                connection.close()
        return _HELD[key]

    def _listening(self) -> Any:
        if self.connection is None:
            if not self.held():
                return None
            connection = _connect(self.alias)
            try:
                connection.execute(f"LISTEN {CHANNEL}")
            except Exception:
                connection.close()
                raise
            self.connection = connection
        return self.connection

    def _probe(self, connection: Any) -> bool:
        """Does a ``NOTIFY`` sent through the queue's database reach a ``LISTEN`` sent on
        ``connection``? Logged either way: how idle workers of the backend wake."""
        channel = f"{CHANNEL}_probe_{secrets.token_hex(8)}"
        connection.execute(f"LISTEN {channel}")
        _notify(self.queue_alias, channel)
        held = bool(list(connection.notifies(timeout=PROBE_WAIT, stop_after=1)))
        connection.execute(f"UNLISTEN {channel}")
        if held:
            logger.info(
                "backend %r: idle workers wake on NOTIFY, listening on database %s", self.backend, address(self.alias)
            )
        else:
            logger.warning(
                "backend %r: a LISTEN on database %s is not held (a pooler in transaction mode?): idle workers "
                "poll every %gs instead of waking at once; OPTIONS['LISTEN_DATABASE'] names a direct connection "
                "to listen on",
                self.backend,
                address(self.alias),
                conf.get("POLL_INTERVAL"),
            )
        return held


def _notify(alias: str, channel: str) -> None:
    """``NOTIFY channel`` through database ``alias``: on Django's connection when it is open in
    autocommit (as the migrations check leaves it at a worker's start), else on a connection of
    its own (a ``NOTIFY`` in a transaction waits for its commit)."""
    wrapper = connections[alias]
    if wrapper.connection is not None and wrapper.get_autocommit():
        with wrapper.cursor() as cursor:
            cursor.execute(f"NOTIFY {channel}")
        return
    notifier = _connect(alias)
    try:
        notifier.execute(f"NOTIFY {channel}")
    finally:
        notifier.close()


def _connect(alias: str) -> Any:
    """A new driver connection of ``alias``, in autocommit, outside Django's connection handling
    and its pool (``OPTIONS["pool"]``: a connection taken from it and closed, never given back,
    would hold one of its places for good)."""
    wrapper = connections[alias]
    return wrapper.Database.connect(**wrapper.get_connection_params(), autocommit=True)
