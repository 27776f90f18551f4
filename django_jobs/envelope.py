"""The message every backend carries: a JSON envelope, signed, never pickled."""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import UTC, datetime
from typing import Any

from . import conf
from .exceptions import InvalidPayload
from .signing import SIGNED_FIELDS


def new_id() -> str:
    return uuid.uuid4().hex


def dumps_payload(payload: Any) -> str:
    """JSON-encode a payload, refusing anything JSON cannot carry (and NaN/Infinity)."""
    try:
        return json.dumps(payload, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise InvalidPayload(f"job payload is not JSON-serialisable: {exc}") from exc


@dataclass(slots=True)
class Envelope:
    """One job message. ``attempts`` is 0-based: runs completed before this delivery."""

    id: str
    handler: str
    payload: Any
    queue: str
    priority: int = 0
    max_retries: int = 0
    attempts: int = 0
    name: str = ""
    idempotency_key: str | None = None
    timeout: float | None = None
    available_at: datetime | None = None
    options: dict[str, Any] = field(default_factory=dict)
    signature: str = ""

    def signed_fields(self) -> dict[str, Any]:
        """The values the signature covers, by name (:data:`~django_jobs.signing.SIGNED_FIELDS`)."""
        return {name: getattr(self, name) for name in SIGNED_FIELDS}

    def next_attempt(self) -> Envelope:
        """A copy with one more completed run, for backends that requeue by re-sending."""
        return replace(self, attempts=self.attempts + 1)

    # -- wire format (used by the brokers; the database backend stores columns) --

    def to_bytes(self) -> bytes:
        data = asdict(self)
        data["v"] = 1
        data["available_at"] = self.available_at.timestamp() if self.available_at else None
        return json.dumps(data, allow_nan=False, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes | str) -> Envelope:
        """Decode bytes from a broker. Raises :class:`InvalidPayload` on anything malformed.

        The size cap is checked before parsing; duplicate keys are refused so that two
        parsers can never disagree about what a signed message says.
        """
        limit = conf.get("MAX_MESSAGE_BYTES")
        if isinstance(raw, str):  # a text body (Service Bus): the cap is on its UTF-8 bytes
            if len(raw) > limit or len(raw.encode("utf-8", "surrogatepass")) > limit:
                raise InvalidPayload(f"message of over {limit} bytes exceeds the cap")
        elif len(raw) > limit:
            raise InvalidPayload(f"message of {len(raw)} bytes exceeds the {limit}-byte cap")
        try:
            data = json.loads(raw, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise InvalidPayload(f"message is not valid JSON: {exc}") from exc
        if not isinstance(data, dict) or data.get("v") != 1:
            raise InvalidPayload("message is not a django-jobs envelope (v1)")
        available_at = data.get("available_at")
        if available_at is not None:
            try:
                data["available_at"] = datetime.fromtimestamp(available_at, tz=UTC)
            except (TypeError, ValueError, OverflowError, OSError) as exc:
                raise InvalidPayload(f"available_at is not a usable timestamp: {exc}") from exc
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Envelope:
        """Build an envelope from untrusted values, checking each field's type."""
        try:
            values = {f.name: data[f.name] for f in fields(cls) if f.name in data}
            env = cls(**values)
        except TypeError as exc:
            raise InvalidPayload(f"malformed envelope: {exc}") from exc
        _check_types(env)
        return env


_TYPES: dict[str, tuple[type, ...]] = {
    "id": (str,),
    "handler": (str,),
    "queue": (str,),
    "priority": (int,),
    "max_retries": (int,),
    "attempts": (int,),
    "name": (str,),
    "idempotency_key": (str, type(None)),
    "timeout": (int, float, type(None)),
    "options": (dict,),
    "signature": (str,),
}


def _check_types(env: Envelope) -> None:
    for name, types in _TYPES.items():
        value = getattr(env, name)
        if not isinstance(value, types) or isinstance(value, bool) and bool not in types:
            raise InvalidPayload(f"envelope field {name!r} has the wrong type ({type(value).__name__})")
    if not env.id or not env.handler or not env.queue:
        raise InvalidPayload("envelope needs an id, a handler and a queue")
    if env.attempts < 0 or env.max_retries < 0:
        raise InvalidPayload("attempts and max_retries must not be negative")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data = dict(pairs)
    if len(data) != len(pairs):
        raise ValueError("duplicate key in JSON object")
    return data


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
