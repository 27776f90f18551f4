"""Built-in handlers: Django management commands and allowlisted programs."""

from __future__ import annotations

import shlex
import subprocess
from typing import Any

from django.core.management import call_command

from . import conf
from .exceptions import HandlerNotAllowed, InvalidPayload


class CommandHandler:
    """Runs a management command. Payload: ``"name"``, ``["name", "arg", ...]`` or
    ``{"name": ..., "args": [...], "options": {...}}``."""

    def handle(self, context: Any) -> None:
        payload = context.payload
        options: dict[str, Any] = {}
        if isinstance(payload, str):
            name, args = payload, []
        elif isinstance(payload, list) and payload and all(isinstance(p, str) for p in payload):
            name, args = payload[0], payload[1:]
        elif isinstance(payload, dict) and isinstance(payload.get("name"), str):
            name, args, options = payload["name"], list(payload.get("args", [])), dict(payload.get("options", {}))
        else:
            raise InvalidPayload("command payload must be a name, an argv list or {'name', 'args', 'options'}")
        call_command(name, *args, **options)


class ShellHandler:
    """Runs an allowlisted program with an argv list, never through a shell.

    ``JOBS["ALLOWED_SHELL_COMMANDS"]`` lists the permitted ``argv[0]`` values, compared
    exactly; empty (the default) permits nothing.
    """

    def handle(self, context: Any) -> str:
        payload = context.payload
        argv = shlex.split(payload) if isinstance(payload, str) else payload
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise InvalidPayload("shell payload must be a non-empty argv list of strings")
        allowed = conf.get("ALLOWED_SHELL_COMMANDS") or ()
        if argv[0] not in allowed:
            raise HandlerNotAllowed(f"program {argv[0]!r} is not in JOBS['ALLOWED_SHELL_COMMANDS']")
        done = subprocess.run(argv, shell=False, capture_output=True, text=True, timeout=context.remaining())
        if done.returncode:
            raise RuntimeError(f"{argv[0]} exited {done.returncode}: {done.stderr[-2000:]}")
        return done.stdout
