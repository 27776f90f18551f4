"""The Redis backend's OPTIONS for Sentinel and for a cluster: parsed without connecting, and
reported by the system check (django_jobs.E016) when they cannot build a client."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from django_jobs.backends import redis_connection
from django_jobs.checks import check_settings


def test_a_sentinel_url_names_every_sentinel_the_service_the_db_and_the_credentials():
    found = redis_connection.sentinels({"URL": "redis+sentinel://u:p%40ss@10.0.0.1:26379,h2:26380/mymaster/3"})
    assert found is not None
    assert found.sentinels == [("10.0.0.1", 26379), ("h2", 26380)]
    assert found.service == "mymaster"
    assert found.primary_kwargs == {"db": 3, "username": "u", "password": "p@ss"}


def test_sentinel_options_take_pairs_a_service_and_the_primarys_credentials():
    options = {
        "SENTINELS": [("127.0.0.1", 26379), ["::1", 26380]],
        "SERVICE": "jobs",
        "DB": 2,
        "PASSWORD": "s3cret",
        "SENTINEL_KWARGS": {"password": "sentinel-secret"},
    }
    found = redis_connection.sentinels(options)
    assert found is not None
    assert found.sentinels == [("127.0.0.1", 26379), ("::1", 26380)]
    assert found.primary_kwargs == {"db": 2, "password": "s3cret"}
    assert found.sentinel_kwargs["password"] == "sentinel-secret"
    assert found.sentinel_kwargs["socket_timeout"] == redis_connection.SENTINEL_TIMEOUT


def test_a_plain_url_has_no_sentinels():
    assert redis_connection.sentinels({"URL": "redis://127.0.0.1:6379/0"}) is None
    assert redis_connection.problem({"URL": "redis://127.0.0.1:6379/0"}) is None


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"SENTINELS": [("127.0.0.1", 26379)]}, "OPTIONS['SERVICE']"),
        ({"SENTINELS": [("127.0.0.1", 26379)], "SERVICE": ""}, "OPTIONS['SERVICE']"),
        ({"SERVICE": "mymaster"}, "a non-empty list of (host, port) pairs"),
        ({"SENTINELS": [], "SERVICE": "mymaster"}, "a non-empty list of (host, port) pairs"),
        ({"SENTINELS": "127.0.0.1:26379", "SERVICE": "mymaster"}, "a non-empty list of (host, port) pairs"),
        ({"SENTINELS": [("127.0.0.1", "26379")], "SERVICE": "mymaster"}, "a (host, port) pair"),
        ({"SENTINELS": [("127.0.0.1", 0)], "SERVICE": "mymaster"}, "a (host, port) pair"),
        ({"SENTINELS": [("h", 1)], "SERVICE": "m", "DB": "2"}, "OPTIONS['DB']"),
        ({"SENTINELS": [("h", 1)], "SERVICE": "m", "SENTINEL_KWARGS": "x"}, "OPTIONS['SENTINEL_KWARGS']"),
        ({"URL": "redis+sentinel://h:1/m", "SENTINELS": [("h", 1)]}, "not both"),
        ({"URL": "redis+sentinel://h/mymaster"}, "host:port"),
        ({"URL": "redis+sentinel://h:1/"}, "a URL of the form"),
        ({"URL": "redis+sentinel://h:1/m/x"}, "a URL of the form"),
        ({}, "OPTIONS['URL']"),
        ({"CLUSTER": True}, "OPTIONS['STARTUP_NODES']"),
        ({"CLUSTER": True, "URL": "redis://h:7000/0", "STARTUP_NODES": [("h", 7000)]}, "not both"),
        ({"CLUSTER": True, "STARTUP_NODES": []}, "a non-empty list of (host, port) pairs"),
        ({"CLUSTER": True, "STARTUP_NODES": ["h:7000"]}, "each of OPTIONS['STARTUP_NODES']"),
        ({"CLUSTER": True, "URL": "redis+sentinel://h:1/m"}, "OPTIONS['CLUSTER'] or Sentinel"),
        ({"CLUSTER": True, "SENTINELS": [("h", 1)], "SERVICE": "m"}, "OPTIONS['CLUSTER'] or Sentinel"),
    ],
)
def test_bad_sentinel_or_cluster_options_say_what_is_needed(options, says):
    problem = redis_connection.problem(options)
    assert problem is not None and says in problem, problem
    with pytest.raises(ImproperlyConfigured, match="redis backend 'q' needs"):
        redis_connection.connect("q", options)


def test_cluster_options_take_a_url_or_startup_nodes():
    assert redis_connection.problem({"CLUSTER": True, "URL": "redis://127.0.0.1:7000/0"}) is None
    assert redis_connection.problem({"CLUSTER": True, "STARTUP_NODES": [("127.0.0.1", 7000), ["h", 7001]]}) is None


def test_a_bad_url_is_reported_without_its_password():
    problem = redis_connection.problem({"URL": "redis+sentinel://user:hunter2@h:1/"})
    assert problem is not None and "hunter2" not in problem and "***@" in problem


def test_the_system_check_reports_a_backend_whose_sentinels_are_wrong(settings):
    backends = {
        **settings.JOBS["BACKENDS"],
        "ha": {"ENGINE": "redis", "OPTIONS": {"SENTINELS": [("127.0.0.1", 26379)]}},
    }
    with override_settings(JOBS={**settings.JOBS, "BACKENDS": backends}):
        errors = [e for e in check_settings() if e.id == "django_jobs.E016"]
    assert len(errors) == 1
    assert errors[0].msg.startswith("backend 'ha' needs OPTIONS['SERVICE']"), errors[0].msg


def test_a_failover_s_errors_are_outages_not_failed_commands():
    import redis

    from django_jobs.backends.redis import RedisBackend

    during = (
        redis.exceptions.ReadOnlyError("READONLY You can't write against a read only replica."),
        redis.sentinel.MasterNotFoundError("No master found for 'mymaster'"),
        redis_connection.NoReplicasError("NOREPLICAS Not enough good replicas to write."),
        redis.exceptions.ClusterDownError("CLUSTERDOWN The cluster is down"),
    )
    for error in during:
        assert isinstance(error, RedisBackend.unavailable_errors), error
    assert not isinstance(redis.ResponseError("ERR wrong number of arguments"), RedisBackend.unavailable_errors)
