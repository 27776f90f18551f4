"""RetryPolicy: each strategy's rule on worked examples (base 5, multiplier 2: 0, 5, 10, 20, 40 s),
plus property tests over the whole range."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone
from hypothesis import given
from hypothesis import strategies as st

from django_jobs import Jobs, signing
from django_jobs.envelope import Envelope
from django_jobs.retry import (
    MAX_DELAY_SECONDS,
    RetryPolicy,
    after_lost_run,
    check_delay,
    clamp_delay,
    has_retries_left,
    may_run,
    policy_for,
    trusted_options,
)

# -- each strategy's rule, on worked examples --


def test_exponential_base_5_multiplier_2_without_jitter():
    policy = RetryPolicy(base=5, strategy="exponential", multiplier=2.0, jitter=False)
    assert [policy.compute_delay(attempt) for attempt in range(1, 6)] == [0, 5, 10, 20, 40]


@pytest.mark.parametrize("strategy", ["none", "fixed", "exponential", "full_jitter"])
@pytest.mark.parametrize("attempt", [1, 0, -3])
def test_first_attempt_and_below_never_wait(strategy, attempt):
    assert RetryPolicy(base=5, strategy=strategy, jitter=True).compute_delay(attempt) == 0


def test_none_never_waits():
    policy = RetryPolicy(base=5, strategy="none", multiplier=3.0, max=1000)
    assert [policy.compute_delay(attempt) for attempt in range(1, 20)] == [0] * 19


def test_fixed_waits_base_capped_at_max():
    assert [RetryPolicy(base=7, strategy="fixed").compute_delay(a) for a in (2, 3, 10)] == [7, 7, 7]
    assert RetryPolicy(base=500, strategy="fixed", max=300).compute_delay(2) == 300


def test_exponential_is_capped_at_max():
    policy = RetryPolicy(base=5, strategy="exponential", multiplier=2.0, max=30, jitter=False)
    assert [policy.compute_delay(a) for a in range(2, 7)] == [5, 10, 20, 30, 30]


@pytest.mark.parametrize("multiplier", [2, 2.0, 10.0])
def test_huge_attempt_numbers_stay_at_max(multiplier):
    # base * multiplier ** 9998 overflows a float: the cap must still apply, not an error.
    policy = RetryPolicy(base=5, strategy="exponential", multiplier=multiplier, max=300, jitter=True)
    assert 0.85 * 300 <= policy.compute_delay(10_000) <= 300
    assert RetryPolicy(base=5, strategy="full_jitter", max=300).compute_delay(10_000) <= 300


def test_jitter_extremes_are_plus_minus_15_percent(monkeypatch):
    policy = RetryPolicy(base=5, strategy="exponential", multiplier=2.0, max=300, jitter=True)
    # Pin the random factor to each end of its range: raw delay of attempt 4 is 20 s.
    monkeypatch.setattr("django_jobs.retry.random.uniform", lambda low, high: low)
    assert policy.compute_delay(4) == pytest.approx(17.0)
    monkeypatch.setattr("django_jobs.retry.random.uniform", lambda low, high: high)
    assert policy.compute_delay(4) == pytest.approx(23.0)


def test_jitter_is_capped_again_after_it_is_applied(monkeypatch):
    monkeypatch.setattr("django_jobs.retry.random.uniform", lambda low, high: high)
    # raw 20 s, +15 % = 23 s, over a max of 22 s: the cap wins (the fix over the PHP library).
    assert RetryPolicy(base=5, multiplier=2.0, max=22, jitter=True).compute_delay(4) == 22
    # raw already capped at 300: jitter can only take it down, never above max.
    assert RetryPolicy(base=5, multiplier=2.0, max=300, jitter=True).compute_delay(12) == 300


def test_jitter_spreads_delays_within_the_band():
    policy = RetryPolicy(base=5, strategy="exponential", multiplier=2.0, max=300, jitter=True)
    delays = [policy.compute_delay(4) for _ in range(400)]
    assert all(17.0 <= d <= 23.0 for d in delays)
    # Jitter actually varies: 400 draws from a 6 s band do not all land in its middle third.
    assert min(delays) < 19 and max(delays) > 21


def test_full_jitter_draws_from_zero_to_the_capped_exponential(monkeypatch):
    calls = []
    monkeypatch.setattr("django_jobs.retry.random.uniform", lambda low, high: calls.append((low, high)) or high)
    # full_jitter uses 2 ** (attempt - 2), whatever the multiplier says.
    assert RetryPolicy(base=5, strategy="full_jitter", multiplier=3.0).compute_delay(4) == 20
    assert RetryPolicy(base=5, strategy="full_jitter", max=60).compute_delay(20) == 60
    assert calls == [(0, 20.0), (0, 60.0)]


def test_full_jitter_range_by_sampling():
    policy = RetryPolicy(base=5, strategy="full_jitter", max=300)
    delays = [policy.compute_delay(4) for _ in range(400)]
    assert all(0 <= d <= 20 for d in delays)
    assert min(delays) < 5 and max(delays) > 15


def test_delays_are_never_negative():
    assert RetryPolicy(base=0, strategy="exponential", jitter=True).compute_delay(5) == 0
    assert RetryPolicy(base=0, strategy="fixed").compute_delay(5) == 0


# -- settings and per-job policies --


def test_from_settings_defaults():
    policy = RetryPolicy.from_settings()
    assert (policy.strategy, policy.base, policy.multiplier, policy.max, policy.jitter) == ("none", 5, 2.0, 300, True)


def test_from_settings_reads_jobs_lazily_under_override_settings():
    # Each key missing from JOBS keeps its default independently.
    with override_settings(JOBS={"RETRY_BACKOFF_STRATEGY": "fixed", "RETRY_BACKOFF_BASE": 9}):
        policy = RetryPolicy.from_settings()
        assert (policy.strategy, policy.base, policy.multiplier, policy.max, policy.jitter) == (
            "fixed",
            9,
            2.0,
            300,
            True,
        )
        assert policy.compute_delay(3) == 9
    with override_settings(
        JOBS={
            "RETRY_BACKOFF_STRATEGY": "exponential",
            "RETRY_BACKOFF_JITTER": False,
            "RETRY_BACKOFF_MULTIPLIER": 3,
            "RETRY_BACKOFF_MAX": 100,
        }
    ):
        assert [RetryPolicy.from_settings().compute_delay(a) for a in (2, 3, 4, 5)] == [5, 15, 45, 100]
    # Back to the test settings once the override ends (nothing cached).
    assert RetryPolicy.from_settings().strategy == "none"


def test_from_settings_overrides_win():
    with override_settings(JOBS={"RETRY_BACKOFF_STRATEGY": "exponential", "RETRY_BACKOFF_MAX": 50}):
        policy = RetryPolicy.from_settings(strategy="fixed", base=80)
    assert (policy.strategy, policy.base, policy.max) == ("fixed", 80, 50)
    assert policy.compute_delay(2) == 50  # the global max still caps a per-job base


def test_per_job_backoff_travels_with_the_envelope_and_overrides_settings():
    env = Jobs.define("command", "check").backoff(strategy="exponential", base=2, multiplier=3.0, jitter=False).build()
    assert env.options["backoff"] == {"strategy": "exponential", "base": 2, "multiplier": 3.0, "jitter": False}
    with override_settings(JOBS={"RETRY_BACKOFF_STRATEGY": "fixed", "RETRY_BACKOFF_BASE": 60}):
        job_policy = policy_for(env.options)
        assert [job_policy.compute_delay(a) for a in (2, 3, 4)] == [2, 6, 18]
        # A job without its own policy follows the global one.
        plain = Jobs.define("command", "check").build()
        assert policy_for(plain.options).compute_delay(4) == 60


def test_malformed_per_job_backoff_off_the_wire_falls_back_to_settings():
    with override_settings(JOBS={"RETRY_BACKOFF_STRATEGY": "fixed", "RETRY_BACKOFF_BASE": 11}):
        assert policy_for({"backoff": {"strategy": "bogus"}}).compute_delay(2) == 11
        assert policy_for({"backoff": "fast"}).compute_delay(2) == 11
        assert policy_for(None).compute_delay(2) == 11


@pytest.mark.parametrize(
    "kwargs",
    [
        {"strategy": "linear"},
        {"strategy": ""},
        {"base": -1},
        {"multiplier": -2.0},
        {"max": -5},
        {"base": float("nan")},
        {"max": float("nan")},
        {"multiplier": float("nan")},
    ],
)
def test_invalid_policy_raises(kwargs):
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)


@pytest.mark.parametrize("kwargs", [{"base": "5"}, {"max": None}, {"multiplier": True}, {"base": [1]}])
def test_a_policy_number_of_the_wrong_type_raises_type_error(kwargs):
    with pytest.raises(TypeError):
        RetryPolicy(**kwargs)


def test_invalid_strategy_in_settings_or_backoff_raises():
    with override_settings(JOBS={"RETRY_BACKOFF_STRATEGY": "linear"}), pytest.raises(ValueError, match="linear"):
        RetryPolicy.from_settings()
    # Refused when the job is defined, not later in the worker.
    with pytest.raises(ValueError):
        Jobs.define("command", "check").backoff(strategy="sometimes")


# -- the maximum delay: refused at dispatch, clamped wherever a delay is read --

HUGE = {"strategy": "fixed", "base": 1e14, "max": 1e14}


@pytest.mark.parametrize(
    "policy",
    [
        RetryPolicy(**HUGE),
        RetryPolicy(base=1e14, strategy="exponential", max=float("inf"), jitter=True),
        RetryPolicy(base=float("inf"), strategy="exponential", multiplier=0.0, max=float("inf"), jitter=False),
        RetryPolicy(base=5, strategy="full_jitter", max=float("inf")),
        RetryPolicy(base=10**400, strategy="fixed", max=10**400),
    ],
)
def test_any_policy_computes_a_finite_delay_of_at_most_a_year(policy):
    for attempt in (2, 3, 50, 10**6):
        delay = policy.compute_delay(attempt)
        assert isinstance(delay, float) and math.isfinite(delay)
        assert 0 <= delay <= MAX_DELAY_SECONDS


def test_a_huge_fixed_backoff_waits_exactly_the_maximum():
    assert MAX_DELAY_SECONDS == 365 * 24 * 3600
    assert RetryPolicy(**HUGE).compute_delay(2) == MAX_DELAY_SECONDS
    assert after_lost_run(0, 3, {"backoff": HUGE}) == MAX_DELAY_SECONDS
    assert after_lost_run(3, 3, {"backoff": HUGE}) is None  # retries spent: failed, no delay


def test_an_int_multiplier_with_a_huge_attempt_count_returns_at_once():
    # 2 ** (2**31) as an exact int would take minutes and gigabytes: the power is taken as a float.
    policy = RetryPolicy(base=5, strategy="exponential", multiplier=2, max=300, jitter=False)
    assert policy.compute_delay(2**31) == 300
    assert after_lost_run(2**40, 2**41, None) is not None


# -- the retry budget: at most max_retries + 1 runs --


@pytest.mark.parametrize("max_retries", [0, 1, 2, 5])
def test_an_always_failing_job_runs_max_retries_plus_one_times(max_retries):
    attempts, runs = 0, 0  # attempts: runs completed before the current one
    while True:
        assert may_run(attempts, max_retries)
        runs += 1
        if not has_retries_left(attempts, max_retries):
            break
        attempts += 1
    assert runs == max_retries + 1
    assert not may_run(runs, max_retries), "a delivery after the last run is failed without running"


@given(attempts=st.integers(min_value=0, max_value=10**6), max_retries=st.integers(min_value=0, max_value=10**6))
def test_the_budget_rules_agree(attempts, max_retries):
    assert has_retries_left(attempts, max_retries) == (attempts < max_retries)
    assert may_run(attempts, max_retries) == (attempts <= max_retries)
    # A lost run is a failed run: it is followed by another exactly when a failed one would be.
    lost = after_lost_run(attempts, max_retries, {"backoff": {"strategy": "none"}})
    assert (lost is not None) == has_retries_left(attempts, max_retries)


@pytest.mark.parametrize("value", [0, 0.5, 30, MAX_DELAY_SECONDS, float(MAX_DELAY_SECONDS)])
def test_check_delay_accepts_finite_delays_up_to_a_year(value):
    assert check_delay(value, "delay") == float(value)


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (-1, ValueError),
        (MAX_DELAY_SECONDS + 1, ValueError),
        (1e14, ValueError),
        (10**400, ValueError),
        (float("inf"), ValueError),
        (float("-inf"), ValueError),
        (float("nan"), ValueError),
        (True, TypeError),
        ("30", TypeError),
        (None, TypeError),
    ],
)
def test_check_delay_refuses_the_rest(value, error):
    with pytest.raises(error, match="delay"):
        check_delay(value, "delay")


@pytest.mark.parametrize(
    ("value", "clamped"),
    [
        (-5, 0.0),
        (float("nan"), 0.0),
        ("x", 0.0),
        (None, 0.0),
        (float("inf"), MAX_DELAY_SECONDS),
        (10**400, MAX_DELAY_SECONDS),
        (-(10**400), 0.0),
        (12.5, 12.5),
    ],
)
def test_clamp_delay(value, clamped):
    assert clamp_delay(value) == clamped


def test_dispatch_refuses_delays_and_backoffs_beyond_a_year_and_accepts_up_to_it():
    builder = Jobs.define("command", "check")
    with pytest.raises(ValueError, match="backoff base"):
        builder.backoff(strategy="fixed", base=MAX_DELAY_SECONDS + 1)
    with pytest.raises(ValueError, match="backoff max"):
        builder.backoff(max=float("inf"))
    with pytest.raises(ValueError, match="multiplier"):
        builder.backoff(multiplier=float("inf"))
    with pytest.raises(ValueError, match="delay"):
        builder.delay(-1)
    with pytest.raises(TypeError, match="delay"):
        builder.delay("30")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="too far ahead"):
        builder.scheduled_at(timezone.now() + timedelta(days=366))
    with pytest.raises(ValueError, match="delay"):  # options() checks at build()
        Jobs.define("command", "check").options(delay=1e14).build()
    env = (
        Jobs.define("command", "check")
        .backoff(strategy="fixed", base=MAX_DELAY_SECONDS, max=MAX_DELAY_SECONDS)
        .delay(timedelta(days=365))
        .build()
    )
    assert env.options["backoff"]["base"] == MAX_DELAY_SECONDS
    past = timezone.now() - timedelta(days=3650)
    assert Jobs.define("command", "check").scheduled_at(past).build().available_at == past  # due at once


def test_reaper_trusts_a_jobs_own_options_only_when_it_verifies():
    env = Envelope(id="job-1", handler="command", payload="check", queue="default", options={"backoff": HUGE})
    env.signature = signing.sign(env)
    assert trusted_options(env, "default") == {"backoff": HUGE}
    assert trusted_options(env, "other") is None  # signed for another queue
    env.options = {"backoff": {**HUGE, "base": 1}}  # changed after signing
    assert trusted_options(env, "default") is None
    env.signature = ""
    assert trusted_options(env, "default") is None
    with override_settings(JOBS={"VERIFY_SIGNATURE": False}):
        assert trusted_options(env, "default") == env.options  # verification turned off: trusted


# -- properties --

finite = {"allow_nan": False, "allow_infinity": False}
bases = st.floats(min_value=0, max_value=1e6, **finite)
multipliers = st.floats(min_value=0, max_value=100, **finite)
maxes = st.floats(min_value=0, max_value=1e7, **finite)
attempts = st.integers(min_value=-5, max_value=2000)
TOLERANCE = 1e-9  # relative: float rounding of raw * factor


def raw_delay(base: float, multiplier: float, maximum: float, attempt: int) -> float:
    if base == 0:
        return 0.0  # base * anything, even a growth factor that overflows
    try:
        return min(base * multiplier ** (attempt - 2), maximum)
    except OverflowError:
        return maximum


@given(
    base=bases,
    multiplier=multipliers,
    maximum=maxes,
    attempt=attempts,
    jitter=st.booleans(),
    strategy=st.sampled_from(["none", "fixed", "exponential", "full_jitter"]),
)
def test_delay_is_between_zero_and_max(base, multiplier, maximum, attempt, jitter, strategy):
    policy = RetryPolicy(base=base, strategy=strategy, multiplier=multiplier, max=maximum, jitter=jitter)
    delay = policy.compute_delay(attempt)
    assert isinstance(delay, float) and not math.isnan(delay)
    assert 0 <= delay <= maximum
    if attempt <= 1 or strategy == "none":
        assert delay == 0


@given(base=bases, multiplier=multipliers, maximum=maxes, attempt=st.integers(min_value=2, max_value=2000))
def test_jittered_delay_stays_within_15_percent_of_the_capped_raw_delay(base, multiplier, maximum, attempt):
    policy = RetryPolicy(base=base, strategy="exponential", multiplier=multiplier, max=maximum, jitter=True)
    raw = raw_delay(base, multiplier, maximum, attempt)
    delay = policy.compute_delay(attempt)
    assert 0.85 * raw * (1 - TOLERANCE) <= delay <= min(1.15 * raw * (1 + TOLERANCE), maximum)


@given(base=bases, multiplier=multipliers, maximum=maxes, attempt=st.integers(min_value=2, max_value=2000))
def test_unjittered_exponential_is_exactly_the_capped_raw_delay(base, multiplier, maximum, attempt):
    policy = RetryPolicy(base=base, strategy="exponential", multiplier=multiplier, max=maximum, jitter=False)
    assert policy.compute_delay(attempt) == pytest.approx(raw_delay(base, multiplier, maximum, attempt), rel=TOLERANCE)


@given(base=bases, maximum=maxes, attempt=st.integers(min_value=2, max_value=2000))
def test_full_jitter_lies_between_zero_and_the_capped_doubling(base, maximum, attempt):
    delay = RetryPolicy(base=base, strategy="full_jitter", max=maximum).compute_delay(attempt)
    assert 0 <= delay <= raw_delay(base, 2.0, maximum, attempt) * (1 + TOLERANCE)
