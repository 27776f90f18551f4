"""The probe of ``bench/startup.py``: runs ``manage.py <arguments>`` as ``python -m django``
does, with each step of a worker's start timestamped into the file ``$STARTUP_PROBE_OUT``, one
line per event: ``pid name time.monotonic() time.process_time()``. (A module of its own, which
imports next to nothing before its first timestamp.)
"""

from __future__ import annotations

import os
import sys
import time
from types import ModuleType

PROBE_OUT = "STARTUP_PROBE_OUT"


def probe(argv: list[str]) -> None:
    """Run ``manage.py <argv>`` as ``python -m django`` does, timestamping each phase
    (``time.monotonic()``, one clock for every process) into the file ``$STARTUP_PROBE_OUT``."""
    out = os.open(os.environ[PROBE_OUT], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    seen: set[tuple[int, str]] = set()

    def mark(name: str) -> None:
        key = (os.getpid(), name)
        if key not in seen:  # the first of each per process
            seen.add(key)
            os.write(out, f"{os.getpid()} {name} {time.monotonic():.6f} {time.process_time():.6f}\n".encode())

    mark("main")
    import importlib.util

    def import_module(name: str, package: str | None = None) -> ModuleType:
        """``importlib.import_module`` through the import statement's machinery, which is
        what ``-X importtime`` times (Django imports apps, models and commands with it)."""
        absolute = importlib.util.resolve_name(name, package) if name.startswith(".") else name
        __import__(absolute)
        return sys.modules[absolute]

    importlib.import_module = import_module
    import django
    from django.core import management

    mark("management")

    def wrap(owner: object, attr: str, event: str, *, after: bool = True) -> None:
        original = getattr(owner, attr, None)
        if original is None:
            return

        def timed(*args: object, **kwargs: object) -> object:
            mark(f"{event}.begin" if after else event)
            try:
                return original(*args, **kwargs)
            finally:
                if after:
                    mark(f"{event}.end")

        setattr(owner, attr, timed)

    def fork() -> int:
        mark("fork")
        pid = real_fork()
        if pid == 0:
            mark("child")
        return pid

    real_fork = os.fork
    os.fork = fork
    wrap(django, "setup", "setup")
    load = management.load_command_class

    def load_command(app: str, name: str) -> object:
        mark("load.begin")
        command = load(app, name)
        mark("load.end")
        from django_jobs.management.commands import _validate
        from django_jobs.presence import Presence
        from django_jobs.reaper import Reaper
        from django_jobs.worker import QueueWorker

        wrap(type(command), "check", "checks")
        wrap(type(command), "handle", "handle.begin", after=False)
        wrap(_validate, "migrated", "migrated")
        wrap(QueueWorker, "run", "run.begin", after=False)
        wrap(QueueWorker, "_deliver", "deliver.begin", after=False)
        wrap(Reaper, "reap_once", "reap")
        wrap(Presence, "beat", "beat")
        built = QueueWorker.__init__

        def init(self: QueueWorker, *args: object, **kwargs: object) -> None:
            built(self, *args, **kwargs)
            mark("worker.built")

        QueueWorker.__init__ = init  # type: ignore[method-assign]
        return command

    management.load_command_class = load_command
    from benches import common  # the harness's job body: INCR bench:done

    body = common.job_body

    def job(*args: object, **kwargs: object) -> None:
        mark("job.begin")
        body(*args, **kwargs)
        mark("job.end")
        if not modules_written:  # what the worker process has imported by its first job's end
            modules_written.append(True)
            with open(os.environ[PROBE_OUT] + ".modules", "w") as held:
                held.write("\n".join(sorted(sys.modules)))

    modules_written: list[bool] = []
    common.job_body = job
    management.execute_from_command_line(["python -m django", *argv])


if __name__ == "__main__":
    probe(sys.argv[1:])
