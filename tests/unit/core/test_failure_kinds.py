"""Failures are classified by exception type and HTTP status, never by a word in the server's
message (issue 36): the real SDK client that ConnectionConfig builds, its requests answered by a
canned transport adapter (no network)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

import pytest
import requests
from requests.adapters import BaseAdapter

from pandastack_jobs import ConnectionConfig, FailureKind, JobSpec, run_job
from pandastack_jobs.testing import FakeClient

Answer = tuple[int, Mapping[str, str], Any]


class _Canned(BaseAdapter):
    """Answers each (method, path) with a fixed (status, headers, JSON body); 404 otherwise."""

    def __init__(self, answers: Mapping[tuple[str, str], Answer]) -> None:
        super().__init__()
        self.answers = answers
        self.seen: list[tuple[str, str]] = []

    def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
        path = urlparse(str(request.url)).path
        self.seen.append((str(request.method), path))
        status, headers, body = self.answers.get(
            (str(request.method), path), (404, {}, {"error": "not found"})
        )
        response = requests.Response()
        response.status_code = status
        response.headers.update({"content-type": "application/json", **headers})
        response._content = json.dumps(body).encode()
        response.request, response.url = request, str(request.url)
        return response

    def close(self) -> None:
        return None


def _run(create: Answer, template: Answer = (200, {}, {"name": "base"})) -> Any:
    conn = ConnectionConfig(
        api_url="http://pandastack.test", api_key="pds_" + "0" * 32, max_create_retry_seconds=0
    )
    client = conn.client()
    adapter = _Canned({("POST", "/v1/sandboxes"): create, ("GET", "/v1/templates/base"): template})
    client.session.mount("http://", adapter)
    return run_job(client, JobSpec(command="true", template="base"))


def _error(message: str) -> dict[str, str]:
    return {"error": message}


def test_a_5xx_mentioning_template_is_not_an_unknown_template_when_the_template_exists() -> None:
    # Today any create error mentioning "template" was dead-lettered.
    outcome = _run((500, {}, _error("template cache is warming up, try again")))
    assert outcome.kind is FailureKind.SERVER_ERROR and outcome.redeliver, outcome.reason


def test_an_unknown_template_is_known_by_the_templates_api_not_by_the_words() -> None:
    outcome = _run(
        (500, {}, _error("image pull failed: manifest unknown")), template=(404, {}, _error("not found"))
    )
    assert outcome.kind is FailureKind.UNKNOWN_TEMPLATE and outcome.dead_letter, outcome.reason
    assert "'base'" in outcome.reason


@pytest.mark.parametrize(
    ("status", "headers", "message", "kind", "retry_after"),
    [
        (503, {"Retry-After": "7"}, "scheduler busy", FailureKind.CAPACITY, 7.0),
        (507, {}, "out of memory for this vm", FailureKind.CAPACITY, 5.0),
        (429, {}, "hourly quota used up", FailureKind.CAPACITY, 1.0),
        # The capacity phrases no longer decide when the status is known:
        (500, {}, "rate limit exceeded in the template engine", FailureKind.SERVER_ERROR, None),
        (503, {}, "no compute capacity available", FailureKind.SERVER_ERROR, None),  # a bare 503
        (400, {}, "no compute capacity available", FailureKind.BAD_REQUEST, None),
    ],
)
def test_capacity_is_known_by_the_status(
    status: int, headers: dict[str, str], message: str, kind: FailureKind, retry_after: float | None
) -> None:
    outcome = _run((status, headers, _error(message)))
    assert outcome.kind is kind, outcome.reason
    assert outcome.retry_after == retry_after


def test_without_a_status_only_the_capacity_phrases_decide_and_never_a_template_word() -> None:
    """A client not built by ConnectionConfig records no status: the capacity phrases are the one
    words match left, and a template word alone never dead-letters."""
    import pandastack

    fake = FakeClient()
    fake.fail("create", pandastack.ServerError("no template cache on this host"))
    outcome = run_job(fake, JobSpec(command="true", template="base"))
    assert outcome.kind is FailureKind.SERVER_ERROR and outcome.redeliver, outcome.reason
    fake.fail("create", pandastack.ServerError("insufficient host memory for sandbox"))
    outcome = run_job(fake, JobSpec(command="true", template="base"))
    assert outcome.kind is FailureKind.CAPACITY and outcome.retry_after == 5.0, outcome.reason
