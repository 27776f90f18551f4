"""Red-team regressions in-process: promises of the docs attacked from outside, one test per
break found (the process-level ones are in tests/processes/test_redteam.py)."""

from __future__ import annotations

import math
import re

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.test import override_settings

from django_jobs.worker import QueueWorker
from tests.testapp import jobs


@pytest.mark.django_db
def test_redteam_jobs_work_refuses_a_backend_database_alias_missing_from_databases():
    """docs/commands.md: a bad argument or setting is refused before anything starts, "with a
    one-line `CommandError: ...` on stderr and exit status 1". Attack: the database backend's
    OPTIONS['DATABASE'] names an alias that DATABASES lacks; jobs_work's migration check raised
    Django's ConnectionDoesNotExist with a traceback."""
    bad = {**settings.JOBS, "BACKENDS": {"default": {"ENGINE": "database", "OPTIONS": {"DATABASE": "nope"}}}}
    with override_settings(JOBS=bad), pytest.raises(CommandError, match=r"'nope'.*DATABASES"):
        call_command("jobs_work", "--once")


@pytest.mark.postgres
@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
@pytest.mark.parametrize("value", [1e20, 1e308, -0.0], ids=["1e20", "1e308", "negative-zero"])
def test_redteam_a_float_in_the_payload_reaches_the_handler_as_that_float_on_postgresql(postgres_up, value):
    """docs/api.md (dispatch validation): the payload may hold `float`s, and what JSON would
    change without a word (an int dict key) is refused, "so the job would get another dict than
    it was given". Attack: a float that PostgreSQL's `jsonb` rewrites: 1e20 is stored as the
    number 100000000000000000000 and handed to the handler as an `int`. (-0.0 loses its sign:
    jsonb has no negative zero, documented as the one change PostgreSQL makes.)
    SQLite and Redis hand back the float."""
    jobs.calls.clear()
    jobs.remember.using(backend="pg").dispatch(value)
    result = QueueWorker("pg", ["default"], prefetch=1).process_once()
    assert result.status == "acked"
    [((got,), _)] = jobs.calls
    assert type(got) is float and got == value, repr(got)
    # jsonb has no negative zero: -0.0 arrives as 0.0, still a float (docs/api.md says so).
    sign = 1 if value == 0 else math.copysign(1, value)
    assert math.copysign(1, got) == sign, repr(got)


# -- production topologies: Redis Sentinel and Redis Cluster options --------------------------------


def _with_redis_backend(options: dict[str, object], queues: list[str] | None = None) -> override_settings:
    """JOBS with a redis backend named ``x`` of these options (and these QUEUES)."""
    backends = {**settings.JOBS["BACKENDS"], "x": {"ENGINE": "redis", "OPTIONS": options}}
    return override_settings(JOBS={**settings.JOBS, "BACKENDS": backends, "QUEUES": queues or settings.JOBS["QUEUES"]})


def _refused(options: dict[str, object], says: str, queues: list[str] | None = None) -> None:
    """`manage.py check` reports E016 for backend ``x``, and its first use raises
    ImproperlyConfigured: the documented answer to options that cannot build a client."""
    from django.core.exceptions import ImproperlyConfigured

    from django_jobs.backends import get_backend
    from django_jobs.checks import check_settings

    with _with_redis_backend(options, queues):
        errors = [e.msg for e in check_settings() if e.id == "django_jobs.E016"]
        assert len(errors) == 1 and says in errors[0], errors
        with pytest.raises(ImproperlyConfigured, match=re.escape(says)):
            get_backend("x").client  # noqa: B018 (builds the client)


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"URL": "REDIS+SENTINEL://h:1/mymaster"}, "redis+sentinel:// URL"),
        ({"URL": "redis+sentinels://h:1/mymaster"}, "redis+sentinel:// URL"),
        ({"URL": "http://h:6379/0"}, "redis+sentinel:// URL"),
        ({"URL": 6379}, "OPTIONS['URL'] to be a string"),
        ({"CLUSTER": True, "URL": "redis://h:notaport/0"}, "Port could not be cast"),
        ({"CLUSTER": True, "URL": "redis://h:7000/3"}, "database 0"),
        ({"SENTINELS": [("h", 26379)], "SERVICE": "m", "SENTINEL_KWARGS": {"pasword": "x"}}, "SENTINEL_KWARGS"),
        ({"CLUSTER": "False", "URL": "redis://127.0.0.1:6379/0"}, "OPTIONS['CLUSTER'] to be True or False"),
    ],
    ids=[
        "uppercase-sentinel-scheme",
        "misspelt-scheme",
        "http",
        "not-a-string",
        "cluster-bad-port",
        "cluster-db-3",
        "sentinel-kwargs-typo",
        "cluster-a-string",
    ],
)
def test_redteam_redis_options_that_cannot_build_a_client_are_e016_not_a_traceback(options, says):
    """docs/settings.md, django_jobs.E016: "A backend's OPTIONS cannot build its client, found
    without connecting"; docs/backends.md: options of the wrong shape are reported by `manage.py
    check` "and the first use raises ImproperlyConfigured". Attack: a URL redis-py refuses (a
    misspelt or upper-case scheme, a port that is not a number, not a string at all), a cluster
    URL naming database 3, a typo in SENTINEL_KWARGS, `CLUSTER: "False"` (a string read from an
    environment variable, which turned cluster mode on). The check said nothing and the first use
    raised redis-py's ValueError, RedisClusterException or TypeError (or an AttributeError)."""
    _refused(options, says)


@pytest.mark.parametrize("queue", ["}", "}urgent"])
def test_redteam_a_cluster_refuses_a_queue_whose_keys_would_have_no_hash_tag(queue):
    """docs/operations.md, Redis Cluster: "Every key of a queue is `<PREFIX>:{<queue>}:<kind>`, so
    the sixteen keys of a queue share one slot". Attack: a queue named `}urgent`. Its keys read
    `djt:{}urgent}:waiting`: Redis takes the empty `{}` for no hash tag and hashes each whole key,
    so each kind of key lands in a slot of its own, and every script of that queue failed with
    `RedisClusterException: EVALSHA - all keys must map to the same key slot` (the dispatch
    itself raised it). Such a queue is refused on a cluster instead (E016)."""
    _refused({"CLUSTER": True, "URL": "redis://127.0.0.1:7000/0"}, f"not {queue!r}", ["default", queue])


@pytest.mark.parametrize("prefix", ["{}", "app{1}", "a}b"])
def test_redteam_a_cluster_refuses_a_prefix_with_braces(prefix):
    """docs/operations.md, Redis Cluster: a queue's slot is "the CRC16 of the queue's name, modulo
    16384; the prefix plays no part", and load "spreads over the primaries by queue". Attack: a
    PREFIX with braces. `app{1}` made `1` the hash tag of every key of every queue and limit (the
    whole cluster's work on one primary); `{}` left every key without a tag (each script spans
    slots and fails). Refused on a cluster (E016)."""
    _refused({"CLUSTER": True, "URL": "redis://127.0.0.1:7000/0", "PREFIX": prefix}, "PREFIX without braces")


def test_redteam_a_sentinel_url_may_name_an_ipv6_sentinel():
    """docs/backends.md: `URL` may be `redis+sentinel://[[user]:password@]host:port[,host:port...]/...`.
    Attack: an IPv6 sentinel, written as URLs write one (`[::1]:26379`). The brackets were kept in
    the host name (`[::1]`), which no resolver knows: every connection failed, as an outage that
    never ends."""
    from django_jobs.backends import redis_connection

    found = redis_connection.sentinels({"URL": "redis+sentinel://[::1]:26379,10.0.0.2:26379/mymaster/0"})
    assert found is not None and found.sentinels == [("::1", 26379), ("10.0.0.2", 26379)]


# -- production topologies: PgBouncer --------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("alias", ["nope", "default"], ids=["missing", "sqlite"])
def test_redteam_a_bad_listen_database_is_a_system_check_error_not_a_traceback(alias):
    """docs/commands.md: "Every command runs Django's system checks first and refuses to start on
    an error"; docs/backends.md: a `LISTEN_DATABASE` that is not a PostgreSQL alias of DATABASES
    makes "the backend refuse to start". Attack: LISTEN_DATABASE names an alias DATABASES lacks,
    or the SQLite one. `manage.py check` found nothing, and `jobs_work` got past its checks and
    died on the backend's ImproperlyConfigured with a traceback."""
    from django.core.management.base import SystemCheckError

    from django_jobs.checks import check_settings

    pooled = {"ENGINE": "database", "OPTIONS": {"DATABASE": "postgres", "LISTEN_DATABASE": alias}}
    jobs_settings = {**settings.JOBS, "BACKENDS": {**settings.JOBS["BACKENDS"], "pooled": pooled}}
    with override_settings(JOBS=jobs_settings):
        errors = [e.msg for e in check_settings() if e.id == "django_jobs.E016"]
        assert errors == [
            f"backend 'pooled' needs OPTIONS['LISTEN_DATABASE'] to name a PostgreSQL database of DATABASES, not {alias!r}"
        ]
        with pytest.raises(SystemCheckError, match="LISTEN_DATABASE"):
            call_command("jobs_work", "--backend", "pooled", "--once", skip_checks=False)


@pytest.mark.postgres
@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
def test_redteam_a_jobs_database_connection_cut_under_it_is_not_handed_to_the_next_job(redis_up, postgres_up):
    """docs/operations.md, PgBouncer: "A restart of PostgreSQL behind PgBouncer lasts, for the
    workers, until PgBouncer logs in again"; docs/backends.md (`reset_connection`): after a
    restarted server or a killed session the thread's next call "connects afresh".

    Attack: a private PostgreSQL restarted behind a private PgBouncer (pool of 1) under four
    worker processes whose jobs write to a second, direct alias. The pooler hid the restart from
    the backend, so nothing reset the jobs' own connection: every later job of each process
    failed on it (`OperationalError: the connection is closed`), 216 of 300 permanently. Here the
    job's session is killed once, on a Redis worker (whose backend never touches PostgreSQL): the
    run that meets the cut fails, the next ones must run."""
    import psycopg
    from django.db import connections

    from django_jobs.worker import QueueWorker

    worker = QueueWorker("redis", ["default"], prefetch=1)
    jobs.scripted.using(backend="redis").dispatch(action="ok", key="before-cut", db="postgres")
    assert worker.process_once().status.value == "acked"

    db = settings.DATABASES["postgres"]
    session = connections["postgres"].connection.info.backend_pid  # the job's connection (this thread's)
    with psycopg.connect(
        host=db["HOST"], port=db["PORT"], user=db["USER"], dbname="postgres", autocommit=True
    ) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [session])
    jobs.scripted.using(backend="redis", max_retries=0).dispatch(action="ok", key="meets-the-cut", db="postgres")
    worker.process_once()  # fails on the dead session: a run of its own

    outcomes = []
    for n in range(3):
        jobs.scripted.using(backend="redis", max_retries=0).dispatch(action="ok", key=f"after-cut-{n}", db="postgres")
        result = worker.process_once()
        outcomes.append((result.status.value, (result.error or "").partition("\n")[0]))
    assert outcomes == [("acked", "")] * 3, outcomes


@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
def test_redteam_a_server_that_is_no_sentinel_does_not_hide_the_others(sentinel_up):
    """docs/operations.md, Redis Sentinel: the backend is given "the sentinels, not a server" and
    asks them who the primary is; docs/api.md: a dispatch to a backend whose server cannot be
    reached raises `BackendUnavailable`. Attack: the URL's first address is a plain Redis server
    (a port mixed up), the three after it are the group's sentinels. redis-py stopped at the
    first one's error reply (`unknown command 'SENTINEL'`): every dispatch and every fetch raised
    that `ResponseError`, though three sentinels could name the primary."""
    from django_jobs.worker import QueueWorker

    url = settings.SENTINEL_URL.replace("redis+sentinel://", "redis+sentinel://127.0.0.1:6379,", 1)
    with _with_redis_backend({"URL": url, "PREFIX": settings.REDIS_PREFIX}):
        job_id = jobs.scripted.using(backend="x").dispatch(action="ok")
        result = QueueWorker("x", ["default"], prefetch=1).process_once()
    assert (result.status.value, result.job_id) == ("acked", job_id), result


@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
def test_redteam_a_queue_name_with_a_nul_character_is_refused(redis_up):
    """docs/backends.md, Dependencies on Redis: a parent's settle writes its outcome into its
    queue's outbox, "which the worker drains at once"; the sweep is the safety net for crashes
    (docs/operations.md: a late release is an alert). Attack: a queue named `a\\0b`. A child in
    that queue waited after its parent completed, released only by the next reaper pass (its
    `dependents` record is `<parent> NUL <child> NUL <queue>`, which the NUL in the name cuts
    short), and on PostgreSQL the dispatch raised `DataError` (text cannot hold NUL). Such a
    name is refused by the check (E010) and at dispatch."""
    from django.core.exceptions import ImproperlyConfigured

    from django_jobs.checks import check_settings

    with override_settings(JOBS={**settings.JOBS, "QUEUES": ["default", "a\x00b"]}):
        errors = [e.msg for e in check_settings() if e.id == "django_jobs.E010"]
        assert errors == ["QUEUES must not hold a NUL character; it holds 'a\\x00b' (a str)"], errors
        with pytest.raises(ImproperlyConfigured, match="NUL"):
            jobs.scripted.using(backend="redis", queue="a\x00b").dispatch(action="ok")


@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
def test_redteam_a_queue_name_longer_than_its_column_is_refused(postgres_up):
    """docs/settings.md: `QUEUES` lists the known queue names. Attack: a name of 200 characters
    (`é` * 200). The database backend on PostgreSQL raised `DataError` (`value too long for
    type character varying(100)`) at dispatch; SQLite stored it whole, and Redis queued it,
    though the `Job` row of its failed or kept jobs has the same 100-character column. Such a
    name is refused by the check (E010) and at dispatch, on every backend."""
    from django.core.exceptions import ImproperlyConfigured

    from django_jobs.checks import check_settings

    long_name = "é" * 200
    with override_settings(JOBS={**settings.JOBS, "QUEUES": ["default", long_name]}):
        errors = [e.msg for e in check_settings() if e.id == "django_jobs.E010"]
        assert len(errors) == 1 and "at most 100 characters" in errors[0], errors
        for backend in ("pg", "default"):
            with pytest.raises(ImproperlyConfigured, match="at most 100 characters"):
                jobs.scripted.using(backend=backend, queue=long_name).dispatch(action="ok")
    with override_settings(JOBS={**settings.JOBS, "QUEUES": ["default", "é" * 100]}):
        assert not [e for e in check_settings() if e.id == "django_jobs.E010"]
        jobs.scripted.using(backend="pg", queue="é" * 100).dispatch(action="ok")
