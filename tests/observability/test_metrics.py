"""Issue 38: ``GET /metrics`` of a real pandastack-local and ``pandastack-jobs consume --metrics-port``
of a real consumer on a real Redis, read with prometheus_client's own parser and by Debian's
``prometheus`` server; the counters move as jobs succeed, fail, are dead-lettered and refused."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e.brokers import Kafka, Redis
from e2e.procs import free_port
from pandastack_jobs import JobSpec, run_job
from pandastack_jobs.queue import open_transport
from pandastack_local import LocalServer
from pandastack_local.testing.procs import stop_group
from pandastack_local.testing.waiting import wait_for
from tests.support.metrics import scrape, value

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = "/usr/bin/prometheus"


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with LocalServer(pool_size=0, max_sandboxes=2) as s:
        yield s


class Consumer:
    """``pandastack-jobs consume --metrics-port 0`` as a real subprocess; ``url`` is its metrics."""

    def __init__(self, broker_url: str, server: LocalServer, log: Path, *extra: str) -> None:
        self.log = log
        argv = [sys.executable, "-m", "pandastack_jobs.queue.cli", "consume", "--broker", broker_url]
        argv += ["--template", "base", "--timeout", "30", "--max-deliveries", "1", "--quiet"]
        argv += ["--metrics-port", "0", "--log-level", "INFO", *extra]
        env = {**os.environ, **server.env(), "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO
            )
        found = wait_for(
            "the consumer's metrics address",
            lambda: re.search(r"metrics on (http://127\.0\.0\.1:\d+)/metrics", log.read_text()),
            timeout=30,
        )
        self.url = found.group(1)

    def stop(self) -> None:
        stop_group(self.proc, 30)


@pytest.fixture(scope="module")
def consumer(
    redis_broker: Redis, server: LocalServer, tmp_path_factory: Any
) -> Iterator[tuple[Consumer, str]]:
    queue = f"q{uuid.uuid4().hex[:8]}"
    c = Consumer(redis_broker.url(queue), server, tmp_path_factory.mktemp("consumer") / "consumer.log")
    yield c, queue
    c.stop()


def send(broker: Redis, queue: str, *bodies: dict[str, Any] | str) -> None:
    for body in bodies:
        broker.r.xadd(queue, {"body": body if isinstance(body, str) else json.dumps(body)})


# -- the server ------------------------------------------------------------------------------------


def test_server_metrics_need_the_key_and_never_show_it(server: LocalServer) -> None:
    r = httpx.get(f"{server.url}/metrics", timeout=10)
    assert r.status_code == 401 and "bearer" in r.json()["detail"]
    r = httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer pds_wrong"}, timeout=10)
    assert r.status_code == 401 and r.json()["detail"].startswith("invalid api token")
    samples = scrape(server.url, server.api_key)
    assert ("pandastack_local_teardown_backlog", ()) in samples


def test_server_counters_move_as_jobs_succeed_fail_and_are_refused(server: LocalServer) -> None:
    before = scrape(server.url, server.api_key)
    client = server.client()
    ok = run_job(client, JobSpec(command='echo \'{"a": 1}\' > "$JOB_RESULT"', template="base", timeout=30))
    failed = run_job(client, JobSpec(command="exit 3", template="base", timeout=30))
    assert ok.ok and not failed.ok
    # The count cap (2): two held, the third refused with 503.
    held = [client.sandboxes.create(template="base") for _ in range(2)]
    try:
        refused = httpx.post(
            f"{server.url}/v1/sandboxes",
            json={"template": "base"},
            headers={"Authorization": f"Bearer {server.api_key}"},
            timeout=30,
        )
        assert refused.status_code == 503
        during = scrape(server.url, server.api_key)
        assert value(during, "pandastack_local_sandboxes", template="base", state="running") == 2
    finally:
        for sb in held:
            client.sandboxes.delete(sb.id)
    after = scrape(server.url, server.api_key)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("pandastack_local_sandbox_create_seconds_count", template="base", mode="cold") == 4
    assert moved("pandastack_local_sandbox_delete_seconds_count", cause="api") == 4
    assert moved("pandastack_local_refusals_total", reason="count_cap") == 1
    assert moved("pandastack_local_exec_seconds_count", mode="stream") >= 2
    route = "/v1/sandboxes"
    assert (
        moved(
            "pandastack_local_http_request_duration_seconds_count", method="POST", route=route, status="503"
        )
        == 1
    )
    assert (
        moved(
            "pandastack_local_http_request_duration_seconds_count", method="POST", route=route, status="201"
        )
        == 4
    )
    assert value(after, "pandastack_local_sandboxes", template="base", state="running") == 0
    assert value(after, "pandastack_local_memory_budget_bytes") > 0
    assert ("pandastack_local_memory_guard_actions_total", (("action", "job_stopped"),)) in after
    assert ("pandastack_local_memory_guard_actions_total", (("action", "sandbox_stopped"),)) in after


def test_a_memory_refusal_is_counted_and_the_keyless_flag_opens_metrics() -> None:
    # A budget with room for one base sandbox (2048 MB): the second create is refused for memory
    # (507); one over the whole budget can never fit (400, never_fits).
    with LocalServer(
        pool_size=0, admission="limits", memory_budget_mb=3000, extra_args=["--metrics-without-key"]
    ) as s:
        headers = {"Authorization": f"Bearer {s.api_key}"}
        held = httpx.post(f"{s.url}/v1/sandboxes", json={"template": "base"}, headers=headers, timeout=60)
        assert held.status_code == 201, held.text
        try:
            r = httpx.post(f"{s.url}/v1/sandboxes", json={"template": "base"}, headers=headers, timeout=60)
            assert r.status_code == 507, r.text
        finally:
            httpx.delete(f"{s.url}/v1/sandboxes/{held.json()['id']}", headers=headers, timeout=60)
        samples = scrape(s.url)  # no key: --metrics-without-key
        assert value(samples, "pandastack_local_refusals_total", reason="memory") == 1
        assert value(samples, "pandastack_local_memory_budget_bytes") == 3000 * 1024 * 1024


def test_server_series_stay_fixed_over_1000_distinct_requests(server: LocalServer) -> None:
    """Cardinality: distinct sandbox ids, commands and metadata (a tenant) add no series."""
    headers = {"Authorization": f"Bearer {server.api_key}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
        sb = http.post("/v1/sandboxes", json={"template": "base", "metadata": {"tenant": "t0"}}).json()

        def round_(i: int) -> None:
            assert http.post(f"/v1/sandboxes/{sb['id']}/exec", json={"cmd": f"echo {i}"}).status_code == 200
            assert http.get(f"/v1/sandboxes/{uuid.uuid4()}").status_code == 404
            assert http.get(f"/no/such/{uuid.uuid4()}").status_code == 404

        try:
            round_(0)
            first = set(scrape(server.url, server.api_key))
            for i in range(1, 1000):
                round_(i)
            last = set(scrape(server.url, server.api_key))
        finally:
            http.delete(f"/v1/sandboxes/{sb['id']}")
    assert last == first, sorted(last ^ first)[:10]


# -- the consumer ----------------------------------------------------------------------------------


def test_consumer_counters_move_as_jobs_are_acked_and_dead_lettered(
    consumer: tuple[Consumer, str], redis_broker: Redis
) -> None:
    c, queue = consumer
    before = scrape(c.url)
    send(
        redis_broker,
        queue,
        {"id": "good", "command": 'echo \'{"ok": true}\' > "$JOB_RESULT"', "tenant": "acme"},
        {"id": "bad", "command": "exit 3"},  # --max-deliveries 1: dead-lettered at once
        "not json",
    )
    wait_for(
        "three messages settled",
        lambda: (
            value(scrape(c.url), "pandastack_queue_messages_received_total")
            - value(before, "pandastack_queue_messages_received_total")
            >= 3
            and value(scrape(c.url), "pandastack_queue_jobs_in_flight") == 0
            and len(redis_broker.dead(queue)) == 2
        ),
        timeout=60,
        interval=0.2,
    )
    after = scrape(c.url)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("pandastack_queue_messages_acked_total") == 1
    assert moved("pandastack_queue_messages_dead_lettered_total", kind="exit_code") == 1
    assert moved("pandastack_queue_messages_dead_lettered_total", kind="malformed") == 1
    assert moved("pandastack_queue_job_duration_seconds_count", outcome="ok") == 1
    assert moved("pandastack_queue_job_duration_seconds_count", outcome="redeliver") == 1
    assert moved("pandastack_queue_end_to_end_seconds_count") == 1
    assert moved("pandastack_queue_message_deliveries_count") == 3
    assert moved("pandastack_queue_chunk_size_count") == 2
    # The backlog is read from Redis (XINFO GROUPS) every few seconds: nothing left waiting.
    wait_for(
        "the backlog read",
        lambda: ("pandastack_queue_backlog_messages", (("state", "leased"),)) in scrape(c.url),
        timeout=15,
    )
    assert value(scrape(c.url), "pandastack_queue_backlog_messages", state="ready") == 0


def test_a_kafka_consumer_reports_its_groups_lag_as_the_backlog(
    kafka_broker: Kafka, server: LocalServer, tmp_path: Path
) -> None:
    """On Kafka the backlog gauge is the groups' lag (end offsets minus committed ones): three
    messages wait before the consumer starts, none once it has settled them, on both topics."""
    queue = f"q{uuid.uuid4().hex[:8]}"
    url = kafka_broker.url(queue)

    producer = open_transport(url, 30)
    producer.connect()
    try:
        for i in range(3):
            producer.send(json.dumps({"id": f"m{i}", "command": 'echo {} > "$JOB_RESULT"'}).encode())
        assert producer.backlog() == {"ready": 3, "delayed": 0}
    finally:
        producer.close()
    c = Consumer(url, server, tmp_path / "consumer.log")
    try:
        wait_for(
            "three acked and the lag read as none",
            lambda: (
                value(samples := scrape(c.url), "pandastack_queue_messages_acked_total") == 3
                and ("pandastack_queue_backlog_messages", (("state", "ready"),)) in samples
                and value(samples, "pandastack_queue_backlog_messages", state="ready") == 0
            ),
            timeout=60,
            interval=0.5,
        )
        assert value(scrape(c.url), "pandastack_queue_backlog_messages", state="delayed") == 0
        assert ("pandastack_queue_backlog_messages", (("state", "leased"),)) not in scrape(c.url)
    finally:
        c.stop()


def test_prometheus_scrapes_the_server_and_the_consumer(
    consumer: tuple[Consumer, str], server: LocalServer, redis_broker: Redis, tmp_path: Path
) -> None:
    """Debian's prometheus (tests/observability/run.sh installs it) scrapes both on loopback, the
    server with its key as the bearer credentials, and answers a query for a counter."""
    c, queue = consumer
    assert os.path.exists(PROMETHEUS), "prometheus is missing: make test-observability installs it (apt)"
    key_file = tmp_path / "key"
    key_file.write_text(server.api_key)
    key_file.chmod(0o600)
    consumer_target = urllib.parse.urlsplit(c.url).netloc
    server_target = urllib.parse.urlsplit(server.url).netloc
    config = tmp_path / "prometheus.yml"
    config.write_text(
        f"""
global: {{scrape_interval: 1s, scrape_timeout: 1s}}
rule_files: ["{REPO / "docs/observability/alerts.yml"}"]
scrape_configs:
  - job_name: pandastack-local
    authorization: {{type: Bearer, credentials_file: {key_file}}}
    static_configs: [{{targets: ["{server_target}"]}}]
  - job_name: pandastack-jobs
    static_configs: [{{targets: ["{consumer_target}"]}}]
"""
    )
    send(redis_broker, queue, {"id": "p1", "command": 'echo \'{"ok": 1}\' > "$JOB_RESULT"'})
    port = free_port()
    data = Path(tempfile.mkdtemp(prefix="prometheus-", dir=tmp_path))
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:

        def query(expr: str) -> list[dict[str, Any]]:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": expr}, timeout=5)
            except httpx.HTTPError:
                return []
            return r.json()["data"]["result"] if r.status_code == 200 else []

        def acked() -> list[dict[str, Any]]:
            got = query('pandastack_queue_messages_acked_total{job="pandastack-jobs"}')
            return got if got and float(got[0]["value"][1]) >= 1 else []

        wait_for("prometheus to read the consumer's acked counter", acked, timeout=60, interval=0.5)
        up = wait_for(
            "prometheus to scrape the server with its key",
            lambda: [r for r in query('up{job="pandastack-local"}') if r["value"][1] == "1"],
            timeout=30,
            interval=0.5,
        )
        assert up
        created = query('sum(pandastack_local_sandbox_create_seconds_count{job="pandastack-local"})')
        assert created and float(created[0]["value"][1]) >= 1
        # The shipped alerting rules loaded (prometheus refuses to start on a bad rule file).
        rules = httpx.get(f"http://127.0.0.1:{port}/api/v1/rules", timeout=5).json()["data"]["groups"]
        names = {r["name"] for g in rules for r in g["rules"]}
        assert names == {
            "PandaStackDeadLetterRateHigh",
            "PandaStackConsumerNotPulling",
            "PandaStackMemoryGuardStoppingJobs",
        }
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        log.close()
        shutil.rmtree(data, ignore_errors=True)


def test_the_dashboard_and_alerts_use_only_documented_metrics_that_exist(
    server: LocalServer, consumer: tuple[Consumer, str]
) -> None:
    """Every metric the dashboard and the alerts query is in docs/observability.md and served."""
    docs = (REPO / "docs/observability.md").read_text()
    auth = {"Authorization": f"Bearer {server.api_key}"}
    served = (
        httpx.get(f"{server.url}/metrics", headers=auth).text + httpx.get(f"{consumer[0].url}/metrics").text
    )
    json.loads((REPO / "docs/observability/grafana-dashboard.json").read_text())
    for path in ("docs/observability/grafana-dashboard.json", "docs/observability/alerts.yml"):
        used = set(re.findall(r"pandastack_(?:local|queue)_[a-z_]+", (REPO / path).read_text()))
        assert len(used) >= 3, path
        for name in used:
            family = re.sub(r"_(bucket|count|sum|total)$", "", name)
            assert f"`{family}`" in docs or f"`{family}_total`" in docs, (path, name)
            assert f"# TYPE {family} " in served or f"# TYPE {family}_total " in served, (path, name)
