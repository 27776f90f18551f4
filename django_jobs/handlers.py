"""Built-in handlers: management commands, allowlisted programs, URLs and named events."""

from __future__ import annotations

import http.client
import ipaddress
import json
import shlex
import socket
import ssl
import subprocess
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from django.core.management import call_command

from . import conf
from .exceptions import HandlerNotAllowed, InvalidPayload
from .signals import emit, job_event

if TYPE_CHECKING:
    from .pipeline import JobContext


class CommandHandler:
    """Runs an allowlisted management command. Payload: ``"name"``, ``["name", "arg", ...]`` or
    ``{"name": ..., "args": [...], "options": {...}}``.

    ``JOBS["ALLOWED_COMMANDS"]`` lists the permitted command names, compared exactly; empty (the
    default) permits nothing, so a job can never run ``flush`` or ``createsuperuser`` unless
    someone listed it.
    """

    def handle(self, context: JobContext) -> None:
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
        if name not in conf.names("ALLOWED_COMMANDS"):  # a str setting is refused, never a substring test
            raise HandlerNotAllowed(f"management command {name!r} is not in JOBS['ALLOWED_COMMANDS']")
        call_command(name, *args, **options)


class EventHandler:
    """Sends the ``job_event`` signal in the worker. Payload: ``{"name": str, "payload": any JSON}``
    (``payload`` may be left out: ``None``).

    ``JOBS["ALLOWED_EVENTS"]`` lists the permitted names, compared exactly; empty (the default)
    permits nothing. The sender is this class, so ``@receiver(job_event, sender=EventHandler)``
    hears every event; receivers tell them apart by ``name``. A receiver that raises is logged
    and counted (``jobs_signal_errors``), and the job still succeeds.
    """

    def handle(self, context: JobContext) -> None:
        payload = context.payload
        if (
            not isinstance(payload, dict)
            or not isinstance(payload.get("name"), str)
            or set(payload) - {"name", "payload"}
        ):
            raise InvalidPayload("event payload must be {'name': str, 'payload': any JSON}")
        name = payload["name"]
        if name not in conf.names("ALLOWED_EVENTS"):  # a str setting is refused, never a substring test
            raise HandlerNotAllowed(f"event {name!r} is not in JOBS['ALLOWED_EVENTS']")
        emit(job_event, type(self), name=name, payload=payload.get("payload"))


class ShellHandler:
    """Runs an allowlisted program with an argv list, never through a shell.

    ``JOBS["ALLOWED_SHELL_COMMANDS"]`` lists the permitted ``argv[0]`` values, compared
    exactly; empty (the default) permits nothing.
    """

    def handle(self, context: JobContext) -> str:
        payload = context.payload
        argv = shlex.split(payload) if isinstance(payload, str) else payload
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise InvalidPayload("shell payload must be a non-empty argv list of strings")
        if argv[0] not in conf.names("ALLOWED_SHELL_COMMANDS"):  # a str setting is refused, never a substring test
            raise HandlerNotAllowed(f"program {argv[0]!r} is not in JOBS['ALLOWED_SHELL_COMMANDS']")
        done = subprocess.run(
            argv, check=False, shell=False, capture_output=True, text=True, timeout=context.remaining()
        )
        if done.returncode:
            raise RuntimeError(f"{argv[0]} exited {done.returncode}: {done.stderr[-2000:]}")
        return done.stdout


class UrlHandler:
    """Calls an http(s) URL. Payload: ``"https://..."`` or ``{"url", "method", "headers", "json"}``.

    Hardened against server-side request forgery: http and https only; the host is resolved
    once and every address must be public (no loopback, private, link-local, multicast or
    reserved ranges, unless ``JOBS["URL_ALLOW_PRIVATE_NETWORKS"]``); the connection goes to that
    vetted address (no second lookup to rebind); redirects are not followed; a non-2xx status fails
    the attempt.
    """

    def handle(self, context: JobContext) -> int:
        payload = context.payload
        spec = {"url": payload} if isinstance(payload, str) else payload
        if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
            raise InvalidPayload(
                "url payload must be a URL or {'url': ..., 'method': ..., 'headers': ..., 'json': ...}"
            )
        url = urlsplit(spec["url"])
        if url.scheme not in ("http", "https") or not url.hostname:
            raise HandlerNotAllowed(f"only http(s) URLs with a host may be called, not {spec['url']!r}")
        port = url.port or (443 if url.scheme == "https" else 80)
        address = _vetted_address(url.hostname, port)
        body = None if spec.get("json") is None else json.dumps(spec["json"]).encode()
        headers = {"Host": url.netloc, "User-Agent": "django-jobs", **dict(spec.get("headers") or {})}
        if body is not None:
            headers.setdefault("Content-Type", "application/json")
        timeout = context.remaining() or 30.0
        if url.scheme == "https":
            conn: http.client.HTTPConnection = _PinnedHTTPS(url.hostname, port, address, timeout=timeout)
        else:
            conn = http.client.HTTPConnection(address, port, timeout=timeout)
        try:
            target = url.path or "/"
            conn.request(
                str(spec.get("method", "POST" if body else "GET")).upper(),
                target + (f"?{url.query}" if url.query else ""),
                body=body,
                headers=headers,
            )
            status = conn.getresponse().status  # http.client never follows redirects
        finally:
            conn.close()
        if not 200 <= status < 300:
            raise RuntimeError(f"{spec['url']} answered HTTP {status}")
        return status


def _vetted_address(host: str, port: int) -> str:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise RuntimeError(f"cannot resolve {host!r}: {exc}") from exc
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    if not conf.get("URL_ALLOW_PRIVATE_NETWORKS"):
        blocked = [a for a in addresses if not a.is_global or a.is_multicast]
        if blocked:
            raise HandlerNotAllowed(f"{host!r} resolves to a non-public address ({blocked[0]}); refused")
    return str(addresses[0])


class _PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to a vetted address, with the certificate checked against the URL's host name."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._address = address

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)  # type: ignore[attr-defined]
