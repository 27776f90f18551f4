"""The envelope wire format (JSON only, never pickle; the size cap is checked before parsing) and its
HMAC signature."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
import uuid
from dataclasses import fields as dataclass_fields
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from django.conf import settings
from django.test import override_settings
from hypothesis import HealthCheck, example, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from django_jobs import Jobs, signing
from django_jobs.backends import get_backend
from django_jobs.envelope import Envelope, dumps_payload, new_id
from django_jobs.exceptions import BadSignature, InvalidPayload


def full_envelope(**changes) -> Envelope:
    """An envelope with every field set to a non-default value, signed."""
    env = Envelope(
        id="0123456789abcdef0123456789abcdef",
        handler="command",
        payload={"x": 1, "l": [1.5, None, "é"]},
        queue="emails",
        priority=4,
        max_retries=3,
        attempts=2,
        name="close month",
        idempotency_key="k1",
        timeout=10.0,
        available_at=datetime(2026, 6, 30, 23, 59, 58, 123456, tzinfo=UTC),
        options={"backoff": {"strategy": "fixed", "base": 3}, "single_instance": True},
    )
    env = replace(env, **changes)
    env.signature = signing.sign(env)
    return env


def as_json(env: Envelope) -> dict:
    return json.loads(env.to_bytes())


def encode(data: dict) -> bytes:
    return json.dumps(data).encode()


# -- wire format --


def test_to_bytes_from_bytes_round_trip_keeps_every_field():
    env = full_envelope()
    assert Envelope.from_bytes(env.to_bytes()) == env
    assert Envelope.from_bytes(env.to_bytes().decode()) == env  # str input as well as bytes


def test_round_trip_without_available_at_and_optional_fields():
    env = Envelope(id="a1", handler="command", payload=None, queue="default")
    env.signature = signing.sign(env)
    back = Envelope.from_bytes(env.to_bytes())
    assert back == env and back.available_at is None and back.idempotency_key is None


def test_available_at_comes_back_as_an_aware_utc_datetime():
    back = Envelope.from_bytes(full_envelope().to_bytes())
    assert back.available_at.utcoffset() == timedelta(0)


def test_to_bytes_is_json_never_pickle():
    data = as_json(full_envelope())
    assert data["v"] == 1 and data["handler"] == "command" and data["payload"]["x"] == 1


def _dup_key() -> bytes:
    raw = full_envelope().to_bytes()
    return b'{"id":"attacker",' + raw[1:]


def _dup_nested_key() -> bytes:
    data = as_json(full_envelope())
    data["payload"] = "@@"
    return encode(data).replace(b'"@@"', b'{"a":1,"a":2}')


def _with(**changes) -> bytes:
    data = as_json(full_envelope())
    for key, value in changes.items():
        if value is _MISSING:
            data.pop(key)
        else:
            data[key] = value
    return json.dumps(data, allow_nan=True).encode()


_MISSING = object()


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"not json", id="garbage"),
        pytest.param(b"\xff\xfe\xfa\x00{}", id="not-utf8"),
        pytest.param(b'{"v":1,"id":"\xc3\x28"}', id="invalid-utf8-in-string"),
        pytest.param(b"[1, 2]", id="array"),
        pytest.param(b"null", id="null"),
        pytest.param(b'"envelope"', id="string"),
        pytest.param(_dup_key(), id="duplicate-key"),
        pytest.param(_dup_nested_key(), id="duplicate-nested-key"),
        pytest.param(_with(payload=float("nan")), id="nan"),
        pytest.param(_with(timeout=float("inf")), id="infinity"),
        pytest.param(_with(priority=float("-inf")), id="minus-infinity"),
        pytest.param(_with(v=2), id="wrong-version"),
        pytest.param(_with(v=_MISSING), id="no-version"),
        pytest.param(_with(id=_MISSING), id="no-id"),
        pytest.param(_with(handler=_MISSING), id="no-handler"),
        pytest.param(_with(id=""), id="empty-id"),
        pytest.param(_with(queue=""), id="empty-queue"),
        pytest.param(_with(id=5), id="id-int"),
        pytest.param(_with(handler=None), id="handler-null"),
        pytest.param(_with(queue=["default"]), id="queue-list"),
        pytest.param(_with(priority="1"), id="priority-str"),
        pytest.param(_with(priority=True), id="priority-bool"),
        pytest.param(_with(priority=1.5), id="priority-float"),
        pytest.param(_with(max_retries=-1), id="max-retries-negative"),
        pytest.param(_with(attempts=-1), id="attempts-negative"),
        pytest.param(_with(attempts="0"), id="attempts-str"),
        pytest.param(_with(name=None), id="name-null"),
        pytest.param(_with(idempotency_key=5), id="idempotency-key-int"),
        pytest.param(_with(timeout="10"), id="timeout-str"),
        pytest.param(_with(timeout=True), id="timeout-bool"),
        pytest.param(_with(options=[]), id="options-list"),
        pytest.param(_with(signature=5), id="signature-int"),
        pytest.param(_with(available_at="2026-01-01T00:00:00Z"), id="available-at-str"),
        pytest.param(b'{"v":1,"payload":' + b"[" * 100_000 + b"]" * 100_000 + b"}", id="deep-nesting"),
        pytest.param(b'{"v":1,"payload":' + b"9" * 5000 + b"}", id="int-too-long"),
    ],
)
def test_from_bytes_rejects_malformed_messages(raw):
    with pytest.raises(InvalidPayload):
        Envelope.from_bytes(raw)


@pytest.mark.parametrize(
    "timestamp",
    [
        pytest.param(1e20, id="overflow-time_t"),
        pytest.param(1e12, id="year-out-of-range"),
        pytest.param(-1e20, id="negative-overflow"),
        pytest.param(10**400, id="int-too-large-for-float"),
    ],
)
def test_from_bytes_rejects_out_of_range_available_at(timestamp):
    with pytest.raises(InvalidPayload):
        Envelope.from_bytes(_with(available_at=timestamp))


def test_size_cap_is_checked_before_parsing():
    raw = full_envelope().to_bytes()
    with override_settings(JOBS={"MAX_MESSAGE_BYTES": len(raw)}):
        assert Envelope.from_bytes(raw) == full_envelope()  # exactly at the cap: accepted
        with pytest.raises(InvalidPayload, match="cap"):
            Envelope.from_bytes(raw + b" ")  # valid JSON, one byte over
    oversize = b" " * (1024 * 1024) + raw  # the default cap is 1 MiB
    with pytest.raises(InvalidPayload, match="cap"):
        Envelope.from_bytes(oversize)


def test_payload_that_json_cannot_carry_is_refused_at_dispatch():
    with pytest.raises(InvalidPayload):
        Jobs.define("command", {"when": datetime.now(UTC)}).build()
    with pytest.raises(InvalidPayload):
        Jobs.define("command", {"x": float("nan")}).build()


@pytest.mark.parametrize(
    ("payload", "refused"),
    [
        ({"text": "a\x00b"}, "U+0000"),
        ({"a\x00": 1}, "U+0000"),
        ({"text": ["half \ud800 a pair"]}, "lone surrogate"),
        ({"text": "low half \udc00 first"}, "lone surrogate"),
        ({"text": "a pair \U0001f600, a backslash-u \\u0000 and \\ud800 typed out"}, None),
    ],
)
def test_payload_no_database_can_store_is_refused_at_dispatch(payload, refused):
    # PostgreSQL cannot store U+0000, and neither a UTF-8 encoder nor jsonb takes a lone surrogate.
    builder = Jobs.define("command", payload)
    if refused is None:
        assert builder.build().payload == payload
        return
    with pytest.raises(InvalidPayload, match=re.escape(refused)):
        builder.build()


# -- signing --


SIGNED_CHANGES = [
    ("id", "fedcba9876543210fedcba9876543210"),
    ("handler", "shell"),
    ("payload", {"x": 2, "l": [1.5, None, "é"]}),
    ("queue", "default"),
    ("priority", 5),
    ("max_retries", 30),
    ("name", "close year"),
    ("idempotency_key", "k2"),
    ("idempotency_key", None),
    ("timeout", 11.0),
    ("timeout", None),
    ("options", {}),
    ("options", {"backoff": {"strategy": "fixed", "base": 300}, "single_instance": True}),
]


# Left out of the signature: they change on every requeue (attempts, available_at), are the
# signature itself, or never leave the process that built the envelope (unlisted_parents).
UNSIGNED_FIELDS = ("attempts", "available_at", "signature", "unlisted_parents")


def test_every_envelope_field_is_either_signed_or_deliberately_left_out():
    names = {f.name for f in dataclass_fields(Envelope)}
    assert set(signing.SIGNED_FIELDS).isdisjoint(UNSIGNED_FIELDS)
    assert set(signing.SIGNED_FIELDS) | set(UNSIGNED_FIELDS) == names
    assert tuple(full_envelope().signed_fields()) == signing.SIGNED_FIELDS
    assert {name for name, _ in SIGNED_CHANGES} == set(signing.SIGNED_FIELDS), "a tampering case per signed field"
    assert "unlisted_parents" not in json.loads(full_envelope().to_bytes())  # never sent


def test_sign_verify_round_trip():
    env = full_envelope()
    assert len(env.signature) == 64 and int(env.signature, 16) >= 0  # hex HMAC-SHA256
    signing.verify(env)
    signing.verify(Envelope.from_bytes(env.to_bytes()))


@pytest.mark.parametrize(("field", "value"), SIGNED_CHANGES, ids=[f"{f}={v!r}" for f, v in SIGNED_CHANGES])
def test_changing_a_signed_field_breaks_the_signature(field, value):
    env = full_envelope()
    tampered = replace(env, **{field: value})  # keeps the old signature
    with pytest.raises(BadSignature):
        signing.verify(tampered)
    # And through the wire format, as a broker would deliver it.
    with pytest.raises(BadSignature):
        signing.verify(Envelope.from_bytes(tampered.to_bytes()))


def test_a_tuple_signs_as_the_list_the_wire_carries():
    # A tuple travels as a JSON list, and an integral float may come back as an int.
    env = full_envelope(payload={"args": [(1.0, 2)], "kwargs": {"t": [(0.5, (3.0,))]}})
    delivered = Envelope.from_bytes(env.to_bytes())
    assert delivered.payload == {"args": [[1.0, 2]], "kwargs": {"t": [[0.5, [3.0]]]}}
    signing.verify(delivered)
    signing.verify(replace(delivered, payload={"args": [[1, 2]], "kwargs": {"t": [[0.5, [3]]]}}))


def test_attempts_and_available_at_are_outside_the_signature():
    env = full_envelope()
    requeued = replace(env, attempts=env.attempts + 1, available_at=env.available_at + timedelta(hours=1))
    signing.verify(requeued)
    signing.verify(env.next_attempt())
    signing.verify(replace(env, available_at=None))


@pytest.mark.parametrize("signature", ["", "0" * 64, "not hex", None])
def test_missing_or_forged_signature_is_rejected(signature):
    with pytest.raises(BadSignature):
        signing.verify(replace(full_envelope(), signature=signature))


def test_flipping_one_signature_character_is_rejected():
    env = full_envelope()
    flipped = env.signature[:-1] + ("0" if env.signature[-1] != "0" else "1")
    with pytest.raises(BadSignature):
        signing.verify(replace(env, signature=flipped))


def test_signing_key_fallbacks_accept_an_old_key_until_removed():
    env = full_envelope()
    with override_settings(JOBS={"SIGNING_KEY": "old-key"}):
        old = replace(env, signature=signing.sign(env))
        signing.verify(old)
    with override_settings(JOBS={"SIGNING_KEY": "new-key", "SIGNING_KEY_FALLBACKS": ["older-key", "old-key"]}):
        signing.verify(old)  # rotation: messages signed before the switch still verify
        new = replace(env, signature=signing.sign(env))
        assert new.signature != old.signature  # new messages use the new key
        signing.verify(new)
    with override_settings(JOBS={"SIGNING_KEY": "new-key", "SIGNING_KEY_FALLBACKS": []}):
        with pytest.raises(BadSignature):
            signing.verify(old)  # the old key was retired
        signing.verify(new)
    with override_settings(JOBS={"SIGNING_KEY": "old-key"}), pytest.raises(BadSignature):
        signing.verify(new)  # fallbacks are for verifying only: the old key knows nothing new


def test_signing_key_may_be_bytes():
    env = full_envelope()
    with override_settings(JOBS={"SIGNING_KEY": b"\x00\xffbinary"}):
        signed = replace(env, signature=signing.sign(env))
        signing.verify(signed)
    with override_settings(JOBS={"SIGNING_KEY": "other"}), pytest.raises(BadSignature):
        signing.verify(signed)


def test_key_is_derived_from_secret_key_when_signing_key_is_none():
    env = full_envelope()
    with override_settings(JOBS={"SIGNING_KEY": None}):
        derived = signing.sign(env)
        assert signing.signing_keys()[0] != settings.SECRET_KEY.encode()
    # Never SECRET_KEY itself: an HMAC keyed by it directly gives another signature.
    direct = hmac.new(settings.SECRET_KEY.encode(), signing.canonical(env.signed_fields()), hashlib.sha256)
    assert derived != direct.hexdigest()
    with override_settings(JOBS={"SIGNING_KEY": settings.SECRET_KEY}):
        assert signing.sign(env) != derived
    # ...but derived from it: another SECRET_KEY, another key, and old messages stop verifying.
    with override_settings(SECRET_KEY="another-secret-key-for-this-test-only", JOBS={"SIGNING_KEY": None}):
        assert signing.sign(env) != derived
        with pytest.raises(BadSignature):
            signing.verify(replace(env, signature=derived))
    with override_settings(JOBS={"SIGNING_KEY": None}):
        signing.verify(replace(env, signature=derived))


def test_test_settings_sign_with_the_derived_key():
    # tests/settings.py sets no SIGNING_KEY: the default signs, never leaves messages unsigned.
    env = Jobs.define("command", "check").build()
    assert env.signature
    signing.verify(env)


# -- properties --

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@given(st.binary(max_size=512))
def test_arbitrary_bytes_decode_or_raise_invalid_payload(raw):
    try:
        env = Envelope.from_bytes(raw)
    except InvalidPayload:
        return
    assert isinstance(env, Envelope)


@given(st.text(max_size=256))
def test_arbitrary_text_decodes_or_raises_invalid_payload(raw):
    try:
        env = Envelope.from_bytes(raw)
    except InvalidPayload:
        return
    assert isinstance(env, Envelope)


FIELDS = [
    "id",
    "handler",
    "payload",
    "queue",
    "priority",
    "max_retries",
    "attempts",
    "name",
    "idempotency_key",
    "timeout",
    "options",
    "signature",
]


@given(
    fields=st.dictionaries(st.sampled_from(FIELDS), json_values),
    base=st.booleans(),
    # Timestamps in the range datetime supports; out-of-range ones have their own test above.
    available_at=st.none() | st.floats(min_value=-1e9, max_value=1e10) | json_values,
)
def test_envelope_shaped_json_decodes_to_well_typed_envelope_or_raises_invalid_payload(fields, base, available_at):
    # Start from a valid envelope (or from nothing) and overwrite fields with arbitrary JSON.
    data = as_json(full_envelope()) if base else {"v": 1}
    data.update(fields)
    if not (
        isinstance(available_at, (int, float))
        and not isinstance(available_at, bool)
        and not -1e9 <= available_at <= 1e10
    ):
        data["available_at"] = available_at
    try:
        env = Envelope.from_bytes(encode(data))
    except InvalidPayload:
        return
    assert isinstance(env.id, str) and env.id and isinstance(env.handler, str) and env.handler
    assert type(env.priority) is int and type(env.max_retries) is int and type(env.attempts) is int
    assert env.attempts >= 0 and env.max_retries >= 0
    assert isinstance(env.options, dict)
    assert env.available_at is None or env.available_at.tzinfo is not None


@given(payload=json_values, name=st.text(max_size=20), priority=st.integers(-(2**31), 2**31 - 1))
def test_any_json_payload_signs_and_verifies_through_the_wire_format(payload, name, priority):
    env = Envelope(id="p1", handler="command", payload=payload, queue="default", name=name, priority=priority)
    env.signature = signing.sign(env)
    signing.verify(Envelope.from_bytes(env.to_bytes()))


@given(
    payload=json_values,
    texts=st.lists(st.text(max_size=40), min_size=5, max_size=5),
    key=st.none() | st.text(max_size=40),
    numbers=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=3, max_size=3),
    timeout=st.none() | st.floats(allow_nan=False, allow_infinity=False),
    available_at=st.none() | st.datetimes(timezones=st.just(UTC)),
)
@example(  # the longest numbers and empty texts: the fixed part alone
    payload=None,
    texts=["", "", "", "", ""],
    key=None,
    numbers=[-(2**31), 2**31 - 1, 2**31 - 1],
    timeout=-1.2345678901234567e-308,
    available_at=datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
)
@example(
    payload=None,
    texts=["\U0001f600" * 200] * 5,
    key="\U0001f600" * 200,
    numbers=[0, 0, 0],
    timeout=None,
    available_at=None,
)
def test_the_size_bound_of_a_message_without_options_is_never_below_its_size(
    payload, texts, key, numbers, timeout, available_at
):
    # A dispatch encodes the message to measure it only when this bound exceeds the cap.
    job_id, handler, queue, name, signature = texts
    priority, max_retries, attempts = numbers
    env = Envelope(
        job_id, handler, payload, queue, priority, abs(max_retries), abs(attempts), name, key, timeout, available_at
    )
    env.signature = signature
    bound = env.size_at_most(len(dumps_payload(payload)))
    assert bound is not None and bound >= len(env.to_bytes())
    assert replace(env, options={"single_instance": True}).size_at_most(0) is None  # options: unknown


# -- signatures survive database storage --

INTEGRAL_FLOATS = {
    "one": 1.0,
    "big": 1e16,
    "e22": 1e22,
    "list": [2.0, -3.0, 0.5],
    "neg_zero": -0.0,
    "tiny": 5e-324,
    "frac": 0.1,
    "nested": {"x": 100.0},
}
BACKENDS = [pytest.param("default", id="sqlite"), pytest.param("pg", id="postgres", marks=pytest.mark.postgres)]


def _db_round_trip(backend_name: str, payload) -> Envelope:
    backend = get_backend(backend_name)
    env = Jobs.define("command", payload).timeout(30.0).build()
    backend.enqueue(env)
    lease = backend.fetch("default")
    assert lease is not None and lease.envelope is not None, lease and lease.error
    backend.ack(lease)
    assert lease.envelope.id == env.id
    return lease.envelope


@pytest.fixture
def db_backend(request):
    if request.param == "pg":
        request.getfixturevalue("postgres_up")
    return request.param


@pytest.mark.django_db(databases=["default", "postgres"])
@pytest.mark.parametrize("db_backend", BACKENDS, indirect=True)
def test_integral_floats_still_verify_after_a_database_round_trip(db_backend):
    fetched = _db_round_trip(db_backend, INTEGRAL_FLOATS)
    signing.verify(fetched)  # jsonb turns 1.0 into 1 and 1e16 into 10000000000000000


@pytest.mark.django_db(databases=["default", "postgres"])
@pytest.mark.parametrize("value", [1e23, 2.0**60, 1e300])
def test_large_integral_floats_still_verify_after_a_postgres_round_trip(value, postgres_up):
    signing.verify(_db_round_trip("pg", {"x": value}))


@pytest.mark.django_db(databases=["default", "postgres"])
@pytest.mark.parametrize("value", [1e23, 2.0**60, 1e300])
def test_large_integral_floats_still_verify_after_a_sqlite_round_trip(value):
    signing.verify(_db_round_trip("default", {"x": value}))


# Floats of magnitude >= 2**53 have their own test above (PostgreSQL round trip).
db_floats = st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: abs(f) < 2**53)


@pytest.mark.django_db(databases=["default", "postgres"])
@pytest.mark.parametrize("db_backend", BACKENDS, indirect=True)
@hypothesis_settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=30)
@given(values=st.lists(db_floats | st.integers(-(2**63), 2**63), min_size=1, max_size=6))
def test_numbers_still_verify_after_a_database_round_trip(db_backend, values):
    signing.verify(_db_round_trip(db_backend, {"values": values, "first": values[0]}))


@pytest.mark.django_db(databases=["default", "postgres"])
def test_nul_character_in_payload_is_stored_or_refused_clearly_on_postgres(postgres_up):
    try:
        fetched = _db_round_trip("pg", {"text": "a\x00b"})
    except InvalidPayload:
        return
    assert fetched.payload == {"text": "a\x00b"}
    signing.verify(fetched)


def test_job_ids_are_uuid7_in_creation_order():
    ids = [new_id() for _ in range(5000)]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)  # strictly increasing within a process
    parsed = [uuid.UUID(hex=value) for value in ids]
    assert {(u.version, u.variant) for u in parsed} == {(7, uuid.RFC_4122)}
    now_ms = time.time_ns() // 1_000_000
    assert all(abs((u.int >> 80) - now_ms) < 60_000 for u in (parsed[0], parsed[-1]))  # Unix milliseconds
    assert len(ids[0]) == 32 and ids[0] == ids[0].lower()
