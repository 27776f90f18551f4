"""The message every backend carries: a JSON envelope, signed, never pickled."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime
from itertools import chain
from typing import Any, NamedTuple

from . import conf
from .exceptions import InvalidPayload
from .ids import uuid7_hex
from .signing import SIGNED_FIELDS


def new_id() -> str:
    """A new job id: a time-ordered UUIDv7 in hex (:mod:`~django_jobs.ids`)."""
    return uuid7_hex()


def dumps_payload(payload: Any) -> str:
    """JSON-encode a payload (or a kept result), refusing anything JSON cannot carry (NaN and
    Infinity included) with the path of the value at fault. Dict keys that JSON turns into
    strings are :func:`check_keys`' business."""
    try:
        return _WIRE.encode(payload)  # as ``to_bytes`` writes it
    except (TypeError, ValueError, RecursionError) as exc:
        problem = payload_problem(payload, "payload")
        raise InvalidPayload(f"job payload is not JSON-serialisable: {problem.text if problem else exc}") from exc


# A JSON-escaped U+0000: "\u0000" after an even number of backslashes.
_ESCAPED_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


# What no backend can store in a text: U+0000 and lone surrogates.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def storable(text: str) -> str:
    """``text`` as every backend can store it: U+0000 (which PostgreSQL refuses) and lone
    surrogates (which no UTF-8 encoder takes) replaced by U+FFFD. An exception's message may
    hold either; written as it is, its settle would fail like an outage, again and again."""
    return _UNSTORABLE.sub("\ufffd", text)


def check_storable(value: Any, text: str) -> None:
    """Refuse a payload or kept result (``text``: its JSON) that holds U+0000, which PostgreSQL
    cannot store, or a lone surrogate, which no UTF-8 encoder takes (PostgreSQL's ``jsonb``
    refuses its escape too). Only a text with an escaped surrogate is looked at again."""
    if _ESCAPED_NUL.search(text):
        raise InvalidPayload("payload contains U+0000, which PostgreSQL cannot store; encode binary data")
    if "\\ud" in text:
        try:
            json.dumps(value, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise InvalidPayload(
                "payload contains a lone surrogate (half of a UTF-16 pair), which no UTF-8 text can hold"
            ) from None


def check_keys(payload: Any, text: str, str_keyed: int = 0) -> None:
    """Refuse a payload with a dict key that is not a str: JSON would turn the key ``1`` into
    ``"1"`` without a word, and the job would get another dict.

    ``text`` is the payload's JSON (from :func:`dumps_payload`), and ``str_keyed`` dicts of it are
    known to have str keys (a ``@job`` payload and its kwargs: 2). Every dict writes a ``{``, so a
    text with no more of them holds no other dict: nothing to look at. Otherwise a payload that is
    fine costs one more look at its containers; only a refused one is walked again, to name the key.
    """
    if text.count("{") > str_keyed and _has_non_str_key(payload):
        problem = payload_problem(payload, "payload")
        raise InvalidPayload(f"job payload has a dict key that is not a str: {problem.text if problem else ''}")


# What json.dumps writes as it is; everything else is a container to look into, or not JSON.
_SCALARS = frozenset({str, int, float, bool, type(None)})
_STR_ONLY = frozenset({str})
_CONTAINERS = (dict, list, tuple)


def _has_non_str_key(value: Any) -> bool:
    """Whether a dict inside ``value`` (a value json.dumps accepted) has a key that is not a str.

    Level by level, so the keys and values of every dict at one depth are looked at in C
    (``set(map(type, ...))``); Python only picks out the containers of the next level.
    """
    level = [value] if isinstance(value, _CONTAINERS) else []
    while level:
        dicts = [item for item in level if isinstance(item, dict)]
        if dicts:
            key_types = set(map(type, chain.from_iterable(dicts)))
            if not key_types <= _STR_ONLY and not all(issubclass(kind, str) for kind in key_types):
                return True
            children = list(chain.from_iterable(map(dict.values, dicts)))
            if len(dicts) < len(level):
                children += chain.from_iterable([item for item in level if not isinstance(item, dict)])
        else:
            children = list(chain.from_iterable(level))
        if set(map(type, children)) <= _SCALARS:
            return False
        level = [child for child in children if type(child) not in _SCALARS and isinstance(child, _CONTAINERS)]
    return False


class PayloadProblem(NamedTuple):
    """Why a value cannot travel as JSON: ``text`` says where and why (``"payload['user'] is a
    User"``); ``where`` is the path of ``culprit``, the offending value, or key when ``is_key``."""

    text: str
    where: str
    culprit: Any
    is_key: bool


# Deeper than json.dumps goes (it stops at the interpreter's recursion limit); a path this long
# would only hide the problem.
_DEEPEST = 1000


def payload_problem(value: Any, path: str) -> PayloadProblem | None:
    """The first place where ``value`` (named ``path``) is not a JSON value with str keys, or
    ``None``. For error messages only: it walks the whole value in Python."""
    seen: set[int] = set()
    pending: list[tuple[Any, str, int]] = [(value, path, 0)]
    while pending:
        item, where, depth = pending.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return PayloadProblem(f"{where} is {item!r} (JSON has no NaN or Infinity)", where, item, False)
        if isinstance(item, (str, int, float, type(None))):
            continue
        if not isinstance(item, (dict, list, tuple)):
            return PayloadProblem(f"{where} is {a_type(item)}", where, item, False)
        if id(item) in seen or depth >= _DEEPEST:  # shared, circular or too deep: json.dumps says why
            continue
        seen.add(id(item))
        if isinstance(item, dict):
            for key in item:
                if not isinstance(key, str):
                    return PayloadProblem(_key_problem(key, where), where, key, True)
            children = [(child, f"{where}[{key!r}]", depth + 1) for key, child in item.items()]
        else:
            children = [(child, f"{where}[{index}]", depth + 1) for index, child in enumerate(item)]
        pending.extend(reversed(children))  # depth first and in order: the first problem is named
    return None


def _key_problem(key: Any, where: str) -> str:
    try:
        [converted] = json.loads(json.dumps({key: None}))
    except TypeError:
        return f"{where} has the key {key!r} ({a_type(key)}): JSON object keys are strings"
    return f"{where} has the key {key!r} ({a_type(key)}), which JSON would turn into {converted!r}"


def a_type(value: Any) -> str:
    """``"a User"``, ``"an int"``: the type of ``value``, for messages (``u`` reads "you": a UUID)."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeio' else 'a'} {name}"


# The most parents a message lists (``options["parents"]``, about 35 bytes each). A job with
# more waits all the same: its parents go from ``build()`` to the backend beside the message
# (``Envelope.unlisted_parents``), and the backend alone keeps its edges.
MESSAGE_PARENTS = 1000


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
    # The parents of a job that has more than MESSAGE_PARENTS, in this process only: never
    # signed, sent or stored (see ``parents``).
    unlisted_parents: list[str] = field(default_factory=list, repr=False, compare=False, metadata={"wire": False})

    @property
    def parents(self) -> list[str]:
        """The ids of the jobs this one waits for, as it was dispatched (none: ``[]``): those
        its message lists, else those built beside it. Read by a backend when it stores the job."""
        listed = self.options.get("parents")
        return list(listed) if isinstance(listed, list) else self.unlisted_parents

    def signed_fields(self) -> dict[str, Any]:
        """The values the signature covers, by name (:data:`~django_jobs.signing.SIGNED_FIELDS`)."""
        return {name: getattr(self, name) for name in SIGNED_FIELDS}

    def next_attempt(self) -> Envelope:
        """A copy with one more completed run, for backends that requeue by re-sending."""
        return replace(self, attempts=self.attempts + 1)

    # -- wire format (used by the brokers; the database backend stores columns) --

    def to_bytes(self) -> bytes:
        # A shallow dict: the encoder reads the payload where it is (asdict would copy it).
        data = {name: getattr(self, name) for name in _WIRE_FIELDS}
        data["v"] = 1
        data["available_at"] = self.available_at.timestamp() if self.available_at else None
        return _WIRE.encode(data).encode()

    def size_at_most(self, payload_size: int) -> int | None:
        """A bound of ``len(self.to_bytes())`` worked out without encoding, given the length of
        the payload's JSON (:func:`dumps_payload`, as ``to_bytes`` writes it); ``None`` when the
        envelope has options (their JSON is not known without encoding them). Each character of
        a text field takes at most 12 bytes (an astral one, two ``\\uXXXX``); the field names,
        numbers and punctuation take less than ``_WIRE_FIXED``."""
        if self.options:
            return None
        texts = (self.id, self.handler, self.queue, self.name, self.idempotency_key or "", self.signature)
        return payload_size + 12 * sum(map(len, texts)) + _WIRE_FIXED

    @classmethod
    def from_bytes(cls, raw: bytes | str, limit: int | None = None) -> Envelope:
        """Decode bytes from a broker. Raises :class:`InvalidPayload` on anything malformed.

        The size cap (``limit``, else ``MAX_MESSAGE_BYTES``: a batch reads it once) is checked
        before parsing; duplicate keys are refused so that two parsers can never disagree about
        what a signed message says.
        """
        if limit is None:
            limit = conf.get("MAX_MESSAGE_BYTES")
        if isinstance(raw, str):  # a text body (Service Bus): the cap is on its UTF-8 bytes
            if len(raw) > limit or len(raw.encode("utf-8", "surrogatepass")) > limit:
                raise InvalidPayload(f"message of over {limit} bytes exceeds the cap")
        elif len(raw) > limit:
            raise InvalidPayload(f"message of {len(raw)} bytes exceeds the {limit}-byte cap")
        try:
            data = _parsed(raw)
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
            values = {name: data[name] for name in _WIRE_FIELDS if name in data}
            env = cls(**values)
        except TypeError as exc:
            raise InvalidPayload(f"malformed envelope: {exc}") from exc
        _check_types(env)
        return env


_WIRE_FIELDS = tuple(f.name for f in fields(Envelope) if f.metadata.get("wire", True))
# Made once (``json.dumps`` with options builds an encoder for every call): messages and payloads.
_WIRE = json.JSONEncoder(allow_nan=False, separators=(",", ":"))
# More than what ``to_bytes`` writes besides the payload and the text fields: every field's name
# and punctuation (about 170 bytes) and the numbers (each at most 25 characters).
_WIRE_FIXED = 512
# More than what a retry adds to the encoded message (the brokers carry it again): ``attempts``
# grows to at most 10 digits and ``available_at`` from ``null`` to a float of at most 24
# characters. A dispatch keeps this room below the size cap, so no retry outgrows it.
RETRY_ROOM = 64

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
        if type(value) in types:  # the exact type, as JSON decodes it: no subclass to weigh
            continue
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


# Made once: ``json.loads`` with hooks builds a decoder and its scanner for every message.
_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_constant=_no_constants)


def _parsed(raw: bytes | str) -> Any:
    """``json.loads(raw, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)``."""
    if isinstance(raw, str):
        if raw.startswith("\ufeff"):
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", raw, 0)
        return _DECODER.decode(raw)
    return _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
