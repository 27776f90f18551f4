"""HMAC-SHA256 signatures over an envelope's immutable fields, with key rotation."""

from __future__ import annotations

import hashlib
import hmac
import json
from decimal import Decimal
from functools import lru_cache
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed

from . import conf
from .exceptions import BadSignature, InvalidPayload

if TYPE_CHECKING:
    from .envelope import Envelope

# The fields a signature covers, the one list of them (``Envelope.signed_fields`` reads it).
# attempts and available_at change on every requeue, so they are left out and a requeued
# message still verifies; everything that decides *what* runs, *where* and *how often* is
# inside the MAC (queue and handler included: no replay elsewhere).
_PLAIN = frozenset({str, int, bool, type(None)})
SIGNED_FIELDS = (
    "id",
    "handler",
    "payload",
    "queue",
    "priority",
    "max_retries",
    "name",
    "idempotency_key",
    "timeout",
    "options",
)

_signed_values = attrgetter(*SIGNED_FIELDS)


# How deep a signed field (the payload: its arguments list and keyword dict, then each argument's
# lists and dicts) may nest. A fixed cap, far below the interpreter's recursion limit: what a
# dispatch signs, a worker verifies whatever the depth of either one's own calls.
MAX_DEPTH = 200


def _normal(value: Any, depth: int = 0) -> Any:
    if type(value) in _PLAIN:  # most fields: nothing to normalise
        return value
    # Storage may turn 1.0 into 1 or 1e16 into 10000000000000000 (PostgreSQL jsonb, a
    # FloatField): an integral float signs as the integer so the MAC survives the round trip.
    if isinstance(value, float):
        # Through the decimal text, as the database keeps it: int(1e23) would be 99999999999999991611392.
        return int(Decimal(repr(value))) if value.is_integer() else value
    if depth >= MAX_DEPTH and isinstance(value, (dict, list, tuple)):
        raise ValueError(f"lists and dicts nested more than {MAX_DEPTH} deep")
    if isinstance(value, dict):
        return {k: _normal(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):  # JSON carries a tuple as a list: signed as one
        return [_normal(v, depth + 1) for v in value]
    return value


_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


# What a value no canonical JSON can hold raises: a non-JSON type, NaN, a lone surrogate (a
# UnicodeEncodeError is a ValueError), nesting past the interpreter's recursion limit.
_UNSIGNABLE = (TypeError, ValueError, OverflowError, RecursionError)


def canonical(fields: dict[str, Any]) -> bytes:
    """Canonical JSON of the signed fields: sorted keys, no spaces, UTF-8."""
    try:
        return _CANONICAL.encode({name: _normal(fields.get(name)) for name in SIGNED_FIELDS}).encode()
    except _UNSIGNABLE as exc:
        raise _unsignable(exc) from exc


def _canonical_of(envelope: Envelope) -> bytes:
    """``canonical(envelope.signed_fields())``, read straight from the envelope."""
    normal = dict(zip(SIGNED_FIELDS, _signed_values(envelope), strict=True))
    try:
        for name, value in normal.items():
            if type(value) not in _PLAIN:  # most fields: nothing to normalise
                normal[name] = _normal(value)
        return _CANONICAL.encode(normal).encode()
    except _UNSIGNABLE as exc:
        raise _unsignable(exc) from exc


def _unsignable(exc: Exception) -> InvalidPayload:
    return InvalidPayload(f"job fields cannot be signed: {exc}")


@lru_cache(maxsize=8)
def _derive(secret: str | bytes) -> bytes:
    # Never sign with SECRET_KEY itself: derive a key dedicated to this purpose.
    return hashlib.sha256(b"django_jobs.signing:" + _as_key(secret)).digest()


def _as_key(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def key_problem(value: Any) -> str | None:
    """Why ``value`` cannot be an HMAC key (never quoting it), or ``None``."""
    if not isinstance(value, (str, bytes)):
        return f"must be a str or bytes, not a {type(value).__name__}"
    if not value:
        return "must not be empty (anyone can compute an HMAC with an empty key)"
    return None


def keys_problem(value: Any) -> str | None:
    """Why ``value`` is not a list of usable keys, or ``None``. A bare str or bytes is refused:
    iterated, it would become one key per character, each trivially guessed."""
    if isinstance(value, (str, bytes)):
        return f"must be a list of keys, not a {type(value).__name__} (each character would be a key)"
    if not isinstance(value, (list, tuple)):
        return f"must be a list of keys, not a {type(value).__name__}"
    for index, key in enumerate(value):
        problem = key_problem(key)
        if problem:
            return f"item {index} {problem}"
    return None


def _checked(setting: str, value: Any, problem: str | None) -> Any:
    if problem:
        raise ImproperlyConfigured(f"{setting} {problem}")
    return value


# The keys worked out from the settings, until a setting they come from changes.
_current_keys: tuple[bytes, ...] | None = None


def signing_keys() -> tuple[bytes, ...]:
    """The current key first, then the fallbacks still accepted when verifying.

    Raises ``ImproperlyConfigured`` for an empty key, a key that is not str or bytes, or a
    str where a list of keys is meant: such settings never sign or verify anything.
    """
    global _current_keys
    if _current_keys is None:  # worked out once per settings: every sign and verify asks
        _current_keys = _signing_keys()
    return _current_keys


def _forget_keys(setting: str, **kwargs: Any) -> None:
    global _current_keys
    if setting in ("JOBS", "SECRET_KEY", "SECRET_KEY_FALLBACKS"):
        _current_keys = None


setting_changed.connect(_forget_keys)


def _signing_keys() -> tuple[bytes, ...]:
    current = conf.get("SIGNING_KEY")
    if current is not None:
        _checked("JOBS['SIGNING_KEY']", current, key_problem(current))
        secret_fallbacks: tuple[Any, ...] = ()  # not used when SIGNING_KEY is set
    else:
        value = getattr(settings, "SECRET_KEY_FALLBACKS", ())
        secret_fallbacks = tuple(_checked("settings.SECRET_KEY_FALLBACKS", value, keys_problem(value)))
    fallbacks = conf.get("SIGNING_KEY_FALLBACKS")
    return _keys(
        current,
        settings.SECRET_KEY,
        secret_fallbacks,
        tuple(_checked("JOBS['SIGNING_KEY_FALLBACKS']", fallbacks, keys_problem(fallbacks))),
    )


@lru_cache(maxsize=8)
def _keys(
    current: Any,
    secret: str,
    secret_fallbacks: tuple[Any, ...],
    fallbacks: tuple[Any, ...],
) -> tuple[bytes, ...]:
    # Read on every sign and verify (the worker's hot path); the inputs are the cache key, so a
    # settings change (override_settings, rotation) takes effect at once.
    if current is not None:
        keys = [_as_key(current)]
    else:
        # Derived from SECRET_KEY, so Django's own rotation (SECRET_KEY_FALLBACKS) carries over.
        keys = [_derive(s) for s in (secret, *secret_fallbacks)]
    return (*keys, *(_as_key(k) for k in fallbacks))


def verify_delivery(envelope: Envelope, queue: str) -> None:
    """What a delivery must pass before any field is trusted: its signature (unless
    ``VERIFY_SIGNATURE`` is off) and the queue it was signed for, so a message replayed onto
    another queue is refused. Raises :class:`BadSignature` (or :class:`InvalidPayload` for
    fields that cannot be encoded)."""
    if conf.get("VERIFY_SIGNATURE"):
        verify(envelope)
    if envelope.queue != queue:
        raise BadSignature(f"job {envelope.id!r} is signed for queue {envelope.queue!r}, delivered on {queue!r}")


@lru_cache(maxsize=16)
def _pads(key: bytes) -> tuple[hashlib._Hash, hashlib._Hash]:
    # HMAC's inner and outer hashes with the key's pads already fed (RFC 2104): each MAC then
    # copies them, so the key is not hashed again for every message.
    block = hashlib.sha256().block_size
    padded = (hashlib.sha256(key).digest() if len(key) > block else key).ljust(block, b"\0")
    return hashlib.sha256(bytes(b ^ 0x36 for b in padded)), hashlib.sha256(bytes(b ^ 0x5C for b in padded))


def _mac(key: bytes, message: bytes) -> str:
    start, end = _pads(key)
    inner, outer = start.copy(), end.copy()
    inner.update(message)
    outer.update(inner.digest())
    return outer.hexdigest()


def sign(envelope: Envelope) -> str:
    """Hex HMAC of the envelope's signed fields with the current key."""
    return _mac(signing_keys()[0], _canonical_of(envelope))


def verify(envelope: Envelope) -> None:
    """Raise :class:`BadSignature` unless one of the keys produced ``envelope.signature``."""
    signature = envelope.signature
    if not signature or not isinstance(signature, str):
        raise BadSignature(f"job {envelope.id!r} has no signature")
    if not signature.isascii():  # compare_digest refuses non-ASCII str with TypeError
        raise BadSignature(f"job {envelope.id!r} has an invalid signature")
    message = _canonical_of(envelope)
    for key in signing_keys():
        if hmac.compare_digest(_mac(key, message), signature):
            return
    raise BadSignature(f"job {envelope.id!r} has an invalid signature")
