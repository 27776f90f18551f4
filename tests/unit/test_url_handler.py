"""The built-in url handler: SSRF-hardened http(s) calls, against a real local HTTP server."""

from __future__ import annotations

import http.server
import threading

import pytest
from django.conf import settings
from django.test import override_settings

from django_jobs import Jobs
from django_jobs.models import Job
from django_jobs.worker import QueueWorker


class _Recorder(http.server.BaseHTTPRequestHandler):
    hits: list[tuple[str, str, bytes]] = []

    def _answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        type(self).hits.append((self.command, self.path, body))
        if self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
        else:
            self.send_response(500 if self.path.startswith("/broken") else 204)
        self.end_headers()

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server():
    _Recorder.hits = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _run(payload) -> tuple[str, Job]:
    job_id = Jobs.define("url", payload).max_retries(0).dispatch()
    result = QueueWorker("default").process_once()
    return result.status, Job.objects.get(pk=job_id)


private_ok = override_settings(JOBS={**settings.JOBS, "URL_ALLOW_PRIVATE_NETWORKS": True})


@pytest.mark.django_db
@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:1/",  # loopback
        "http://10.0.0.1/",  # private
        "http://169.254.169.254/latest/meta-data/",  # link-local (cloud metadata)
        "http://[::1]/",  # IPv6 loopback
        "http://localhost/",  # a name resolving to loopback is refused after resolution
    ],
)
def test_non_public_targets_are_refused_without_a_request(url, server):
    status, row = _run(url)
    assert status == "dead-lettered"
    assert row.last_error.startswith("HandlerNotAllowed:")
    assert _Recorder.hits == []


@pytest.mark.django_db
@pytest.mark.parametrize("url", ["file:///etc/passwd", "gopher://example.com/", "ftp://example.com/x"])
def test_only_http_and_https_are_allowed(url):
    status, row = _run(url)
    assert status == "dead-lettered" and row.last_error.startswith("HandlerNotAllowed:")


@pytest.mark.django_db
def test_a_permitted_call_sends_the_json_body(server):
    with private_ok:
        status, row = _run({"url": f"{server}/hook?x=1", "json": {"order": 7}})
    assert status == "acked", row.last_error
    assert _Recorder.hits == [("POST", "/hook?x=1", b'{"order": 7}')]


@pytest.mark.django_db
def test_redirects_are_not_followed(server):
    with private_ok:
        status, row = _run(f"{server}/redirect")
    assert status == "dead-lettered" and "HTTP 302" in row.last_error
    assert [hit[1] for hit in _Recorder.hits] == ["/redirect"]  # nothing fetched at the Location


@pytest.mark.django_db
def test_an_error_status_fails_the_attempt(server):
    with private_ok:
        status, row = _run(f"{server}/broken")
    assert status == "dead-lettered" and "HTTP 500" in row.last_error
