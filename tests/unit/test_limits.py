"""Limits without a backend: rates, keys, which limits a job is under, and the rate rule on
fixed clocks (a start's time is a number here; nothing sleeps)."""

from __future__ import annotations

import bisect
from collections.abc import Iterator

import pytest
from django.core.exceptions import ImproperlyConfigured
from hypothesis import given
from hypothesis import strategies as st

from django_jobs import Jobs, job, limits
from django_jobs.api import JobFunction
from django_jobs.limits import Limit, format_rate, limits_for, parse_rate, rate_slot, reservation_state
from tests.api_support import jobs_settings


def capped() -> None:
    """Becomes a job whose handler declares its limits (``declared``)."""


CAPPED = "tests.unit.test_limits.capped"


@pytest.fixture
def declared() -> Iterator[JobFunction[[], None]]:
    """``@job(concurrency=2, rate="100/m")`` on ``capped``, for one test: other tests never see it."""
    yield job(concurrency=2, rate="100/m")(capped)
    limits.declare(CAPPED)


# -- rates ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "count", "period"),
    [
        ("10/s", 10, 1),
        ("100/m", 100, 60),
        ("1000/h", 1000, 3600),
        ("5/d", 5, 86400),
        ("5/10s", 5, 10),
        (" 3 / 2m", 3, 120),
    ],
)
def test_a_rate_is_starts_per_period(text, count, period):
    assert parse_rate(text) == (count, float(period))
    assert parse_rate(format_rate(count, float(period))) == (count, float(period))


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("0/m", "at least one start per period"),
        ("10/0s", "the period must be at least 1s"),
        ("10/w", "units s, m, h, d"),
        ("10 per minute", "write starts/period"),
        ("-1/s", "write starts/period"),
        ("1.5/s", "write starts/period"),
        ("", "write starts/period"),
    ],
)
def test_a_bad_rate_says_what_to_write(text, error):
    with pytest.raises(ValueError, match=error):
        parse_rate(text)


def test_a_rate_that_is_not_a_string_is_a_type_error():
    with pytest.raises(TypeError, match="a rate is a string such as '100/m', not 100"):
        parse_rate(100)


def test_rates_are_written_back_in_their_largest_unit():
    assert [format_rate(1, p) for p in (1.0, 60.0, 120.0, 3600.0, 86400.0, 90.0)] == [
        "1/s", "1/m", "1/2m", "1/h", "1/d", "1/90s",
    ]  # fmt: skip


# -- limits and the setting ----------------------------------------------------------------------


def test_a_limit_needs_a_valid_key_and_a_cap():
    assert Limit.build("queue:emails", concurrency=5, rate="10/s") == Limit("queue:emails", 5, 10, 1.0)
    for key in ("emails", "queues:emails", "queue:", 5):
        with pytest.raises(ValueError, match="limit key"):
            Limit.build(key, concurrency=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a concurrency, a rate, or both"):
        Limit.build("queue:emails")
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="concurrency must be an int >= 1"):
            Limit.build("queue:emails", concurrency=bad)


def test_every_bad_entry_of_the_setting_is_reported():
    found = limits.problems(
        {
            "queue:emails": {"concurrency": 5, "rate": "10/s"},
            "queue:a": {"concurrency": 0},
            "handler:b": {"rate": "1/w"},
            "queue:c": {"concurrency": 1, "burst": 3},
            "queue:d": {},
            "e": {"concurrency": 1},
            "queue:f": 5,
        }
    )
    assert found == [
        "LIMITS['queue:a']: concurrency must be an int >= 1 or None, not 0 (an int)",
        "LIMITS['handler:b']: bad rate '1/w': write starts/period, e.g. '10/s', '100/m', '1000/h', '5/10s' (units s, m, h, d)",
        "LIMITS['queue:c'] has unknown key(s) 'burst': use 'concurrency' and 'rate'",
        "LIMITS['queue:d'] is empty: give a 'concurrency', a 'rate', or both",
        "bad limit key 'e': write 'queue:<queue name>' or 'handler:<handler key>'",
        "LIMITS['queue:f'] must be a dict such as {'concurrency': 5, 'rate': '10/s'}, not 5 (an int)",
    ]
    assert limits.problems([]) == [
        "LIMITS must be a dict of limit key -> {'concurrency': ..., 'rate': ...}, not [] (a list)"
    ]


def test_a_job_is_under_its_queues_and_its_handlers_limits_in_key_order():
    table = {"queue:emails": {"concurrency": 5}, "handler:send": {"rate": "10/s"}, "queue:other": {"concurrency": 1}}
    with jobs_settings(LIMITS=table):
        assert limits_for("send", "emails") == (
            Limit("handler:send", None, 10, 1.0),
            Limit("queue:emails", 5, None, None),
        )
        assert limits_for("other-handler", "default") == ()


def test_a_declared_limit_applies_and_the_setting_overrides_it_cap_by_cap(declared):
    assert limits_for(CAPPED, "default") == (Limit(f"handler:{CAPPED}", 2, 100, 60.0),)
    with jobs_settings(LIMITS={f"handler:{CAPPED}": {"rate": "5/s"}}):
        assert limits_for(CAPPED, "default") == (Limit(f"handler:{CAPPED}", 2, 5, 1.0),)
    with jobs_settings(LIMITS={f"handler:{CAPPED}": {"rate": None}}):
        assert limits_for(CAPPED, "default") == (Limit(f"handler:{CAPPED}", 2, None, None),)
    with jobs_settings(LIMITS={f"handler:{CAPPED}": {"rate": None, "concurrency": None}}):
        assert limits_for(CAPPED, "default") == ()


def test_limits_follow_a_change_of_settings():
    with jobs_settings(LIMITS={"queue:emails": {"concurrency": 1}}):
        assert limits_for("send", "emails") == (Limit("queue:emails", 1),)
    assert limits_for("send", "emails") == ()


def test_a_bad_setting_is_refused_when_limits_are_used():
    with jobs_settings(LIMITS={"queue:emails": {"rate": "fast"}}), pytest.raises(ImproperlyConfigured, match="fast"):
        limits_for("send", "emails")


def test_a_bad_declared_limit_is_refused_where_the_decorator_is():
    def f() -> None: ...

    with pytest.raises(ValueError, match="concurrency must be an int >= 1"):
        job(concurrency=0)(f)
    with pytest.raises(ValueError, match="bad rate"):
        job(rate="lots")(f)


def test_limits_belong_to_the_handler_not_to_one_call(declared):
    with pytest.raises(
        TypeError, match=r"concurrency limit every job of a handler.*@job\(\.\.\.\) or JOBS\['LIMITS'\]"
    ):
        declared.using(concurrency=1)  # type: ignore[typeddict-unknown-key]
    with pytest.raises(TypeError, match="rate limit every job of a handler"):
        Jobs.define(CAPPED).options(rate="1/s")  # type: ignore[typeddict-unknown-key]
    assert "concurrency" not in declared.defaults  # it never reaches a message


# -- the rate rule on fixed clocks ---------------------------------------------------------------


def fits(starts: list[float], count: int, period: float) -> bool:
    """Does every window [t, t + period) hold at most ``count`` starts? (To the microsecond:
    the times are floats, stored with microseconds.)"""
    ordered = sorted(starts)
    return all(ordered[i + count] - ordered[i] >= period - 1e-6 for i in range(len(ordered) - count))


def test_the_first_starts_of_a_window_are_granted_at_once_then_the_next_is_a_period_later():
    assert rate_slot([], 100.0, 2, 60.0) == 100.0
    assert rate_slot([100.0], 110.0, 2, 60.0) == 110.0
    assert rate_slot([100.0, 110.0], 120.0, 2, 60.0) == 160.0
    assert rate_slot([100.0, 110.0, 160.0], 120.0, 2, 60.0) == 170.0  # after the reservation
    assert rate_slot([100.0, 110.0], 200.0, 2, 60.0) == 200.0  # both left the window


def test_a_reserved_start_is_early_then_due_then_lapses():
    assert reservation_state(160.0, 159.9, 60.0) == "early"
    assert reservation_state(160.0, 160.0, 60.0) == "due"
    assert reservation_state(160.0, 160.0 + limits.RESERVATION_GRACE, 60.0) == "due"
    assert reservation_state(160.0, 160.1 + limits.RESERVATION_GRACE, 60.0) == "lapsed"
    assert reservation_state(160.0, 161.5, 1.0) == "lapsed"  # never more than a period late


@given(
    count=st.integers(1, 5),
    period=st.sampled_from([1.0, 10.0, 60.0]),
    gaps=st.lists(st.floats(0, 30, allow_nan=False), min_size=1, max_size=60),
)
def test_starts_taken_by_the_rule_never_crowd_a_window(count, period, gaps):
    """Jobs ask at increasing times; each takes the slot the rule gives it (now or reserved):
    any window of ``period`` seconds then holds at most ``count`` of them, and each slot is
    the earliest that does."""
    now, starts = 1000.0, []
    for gap in gaps:
        now += gap
        slot = rate_slot(starts, now, count, period)
        assert slot >= now
        if slot > now:  # the earliest: a moment before would crowd a window
            assert not fits([*starts, max(now, slot - 0.01)], count, period)
        starts.append(slot)
        assert fits(starts, count, period)


@given(
    count=st.integers(1, 4),
    gaps=st.lists(st.floats(0, 20, allow_nan=False), min_size=1, max_size=40),
    late=st.lists(st.floats(0, 3, allow_nan=False), min_size=40, max_size=40),
)
def test_reserved_jobs_start_when_they_come_back_without_asking_again(count, gaps, late):
    """A job given a later slot comes back a little late (within the grace): its start is
    due, taken at its slot, and the window still holds at most ``count`` starts."""
    period, now, starts, waiting = 10.0, 0.0, [], []
    for gap, delay in zip(gaps, late, strict=False):
        now += gap
        for slot in [slot for slot in waiting if slot + delay <= now]:  # back from their wait
            assert reservation_state(slot, max(now, slot), period) in ("due", "lapsed")
            waiting.remove(slot)
        slot = rate_slot(starts, now, count, period)
        bisect.insort(starts, slot)
        if slot > now:
            waiting.append(slot)
            assert reservation_state(slot, slot + delay, period) == "due"
        assert fits(starts, count, period)


@given(
    count=st.integers(1, 4),
    starts=st.lists(st.floats(0, 100, allow_nan=False), max_size=30),
    now=st.floats(0, 150, allow_nan=False),
)
def test_any_time_from_the_rules_answer_on_keeps_every_window_within_the_rate(count, starts, now):
    """Whatever starts are held (reservations given up leave holes), the answer and any later
    time are safe to add."""
    period = 10.0
    kept = sorted(starts)
    # Only sets the rule could have produced: every window within the rate.
    kept = [t for i, t in enumerate(kept) if fits(kept[: i + 1], count, period)]
    if not fits(kept, count, period):
        return
    slot = rate_slot(kept, now, count, period)
    for later in (slot, slot + 0.5, slot + period / 3):
        assert fits([t for t in kept if t > now - period] + [later], count, period)
