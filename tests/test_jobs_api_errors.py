"""How rayapp's Jobs API client reads refusals: by HTTP status and Ray's exception types, not by
words in a message. Ray's own JobSubmissionClient talks to small HTTP servers in this process:
one that is no Ray dashboard at all, and a stand-in for a dashboard's job head that answers as
Ray's does (ray/dashboard/modules/job/job_head.py) in states a real head is in only briefly or by
accident (no job agent yet right after start-up). A real dashboard's answers are checked in
tests/test_remote_integration.py (an unknown job id, a missing or wrong token)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rayapp.errors import RayappError
from rayapp.launch import jobs_api


class JobHead(BaseHTTPRequestHandler):
    """/api/version as Ray 2.60 answers it; /api/jobs/<id>: 404, as for an id the head never saw;
    POST /api/jobs/: 500 "No available agent" for the first `agent_missing_for` submissions, and
    400 for the entrypoint "refuse" (as for a runtime_env the head cannot read)."""

    agent_missing_for = 2
    submissions = 0

    def log_message(self, *args: object) -> None:
        pass

    def answer(self, status: int, body: str) -> None:
        self.send_response(status)
        self.end_headers()
        self.wfile.write(body.encode())

    def do_GET(self) -> None:
        if self.path == "/api/version":
            self.answer(200, json.dumps({"version": "4", "ray_version": "2.60.0"}))
        else:
            self.answer(404, f"Job {self.path.rsplit('/', 1)[-1]} does not exist")

    def do_POST(self) -> None:
        type(self).submissions += 1
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if request["entrypoint"] == "refuse":
            self.answer(400, "bad runtime_env\nTraceback (most recent call last): ...")
        elif self.submissions <= self.agent_missing_for:
            self.answer(500, "No available agent to submit job, please try again later.")
        else:
            self.answer(200, json.dumps({"submission_id": "raysubmit_1", "job_id": None}))


class NotADashboard(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(404)
        self.end_headers()


def serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def head() -> Iterator[str]:
    JobHead.submissions = 0
    yield from serve(JobHead)


@pytest.fixture
def not_a_dashboard() -> Iterator[str]:
    yield from serve(NotADashboard)


def test_an_unknown_job_is_named_from_the_404(head):
    client = jobs_api.connect(head)
    with pytest.raises(RayappError) as error:
        jobs_api.job_info(client, "raysubmit_nope", head)
    assert str(error.value).startswith(f"no job 'raysubmit_nope' on the Ray cluster at {head}")


def test_a_submission_waits_for_the_job_agent(head):
    client = jobs_api.connect(head)
    jobs_api.submit_with_retry(lambda: client.submit_job(entrypoint="true"), head)
    assert JobHead.submissions == 3


def test_a_refusal_other_than_no_agent_is_not_retried(head):
    client = jobs_api.connect(head)
    with pytest.raises(RayappError) as error:
        jobs_api.submit_with_retry(lambda: client.submit_job(entrypoint="refuse"), head)
    assert str(error.value) == (
        f"the Ray Jobs API at {head} refused the request: HTTP 400: bad runtime_env"
    )
    assert JobHead.submissions == 1


def test_an_address_without_a_jobs_api_is_one_line(not_a_dashboard):
    with pytest.raises(RayappError) as error:
        jobs_api.connect(not_a_dashboard)
    assert str(error.value).startswith(f"{not_a_dashboard} is not a Ray dashboard")
    assert "\n" not in str(error.value)
