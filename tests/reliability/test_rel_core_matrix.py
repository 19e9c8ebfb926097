"""The hostile-job matrix through the core (``run_job``), each case next to well-behaved siblings.

For every case: the hostile job's outcome and class are the documented ones, the siblings
succeed with correct results, the orchestrator (this process) keeps its memory and file
descriptors, nothing of the job is left on the host (process, cgroup, dir, mount, sandbox),
and no secret reaches an outcome or a log.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from pandastack_jobs import ConnectionConfig, FailureKind, JobKey, JobOutcome, JobSpec, run_job
from pandastack_local.testing.procs import pids_matching, rss_and_fds
from pandastack_local.testing.waiting import wait_for
from tests.reliability.catalogue import (
    CANARY_NAME,
    CANARY_VALUE,
    ESCAPE_PROBE,
    FAKE_TOKEN,
    HOSTILE_CASES,
    SIBLING_JOB,
    SIBLING_WITH_SECRET,
    TEMPLATE,
    TEMPLATE_FILE,
    TEMPLATE_FILE_TEXT,
    Hostile,
    counted,
    hostile_files,
    sibling_expected,
    sibling_rows,
)
from tests.reliability.probes import FakeListener, Recorder, host_ip, outcome_text, secret_free
from tests.support.server import GVISOR

pytestmark = pytest.mark.reliability

RSS_SLACK_KB = 64 * 1024  # the orchestrator never holds what the job allocates (GiBs)
FD_SLACK = 3


@pytest.fixture(scope="module")
def client(rel_server: Any) -> Any:
    return ConnectionConfig(api_url=rel_server.url, api_key=rel_server.api_key).client()


@pytest.fixture(scope="module")
def warm(client: Any) -> None:
    """Fill the HTTP connection pool and import everything once, so later fd/RSS deltas are real."""
    outcomes = run_all(client, [sibling_spec(i, "warmup") for i in range(3)], None)
    assert all(o.ok for o in outcomes), [o.reason for o in outcomes]


def sibling_spec(i: int, case: str) -> JobSpec:
    return JobSpec(
        command="python3 sibling.py",
        files={"sibling.py": SIBLING_JOB},
        input={"rows": sibling_rows(i)},
        template=TEMPLATE,
        timeout=90,
        key=JobKey("core", "reliability", f"{case}-sibling-{i}", uuid.uuid4().hex),
    )


def run_all(client: Any, specs: list[JobSpec], recorder: Recorder | None) -> list[JobOutcome]:
    """Run every spec at once, each in its own thread (as a worker pool would)."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(run_job, client, spec, on_created=recorder) for spec in specs]
        return [f.result(timeout=300) for f in futures]


@pytest.mark.parametrize("case", HOSTILE_CASES, ids=lambda c: c.name)
def test_hostile_job_fails_alone(
    case: Hostile, rel_server: Any, host: Any, client: Any, warm: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    marker = f"ps-rel-{case.name}-{uuid.uuid4().hex[:8]}"
    rss0, fds0 = rss_and_fds()
    recorder = Recorder(host)
    hostile = JobSpec(
        command=f"python3 job.py {marker}",
        files=hostile_files(case),
        template=TEMPLATE,
        timeout=case.timeout,
        key=JobKey("core", "reliability", case.name, uuid.uuid4().hex),
    )
    started = time.monotonic()
    outcomes = run_all(client, [hostile] + [sibling_spec(i, case.name) for i in range(2)], recorder)
    elapsed = time.monotonic() - started
    bad, siblings = outcomes[0], outcomes[1:]
    detail = outcome_text(bad)

    # The hostile job: one classified failure, the documented kind and class.
    assert not bad.ok, detail
    assert bad.kind is case.expected_kind, detail
    assert bad.failure_class is case.failure_class, detail
    # (gVisor: the sentry fails the allocation, the job ends with its own error, not SIGKILL)
    oom_killed = case.expected_kind is FailureKind.EXIT_CODE and not GVISOR
    if oom_killed and case.name in ("memory_hog", "decompression_bomb"):
        assert bad.exit_code == 137 and "SIGKILL" in bad.reason, detail
        assert "no wall" not in bad.stdout_tail, detail
    if case.expected_kind is FailureKind.TIMEOUT:
        assert bad.timings.exec >= case.timeout, detail
        assert bad.timings.exec < case.timeout + 60, detail  # cut at the deadline, not after minutes
        assert "no wall" not in bad.stdout_tail, detail
    if case.counter is not None:
        reached = counted(bad.stdout_tail, case.counter)
        assert reached is not None and reached <= (case.wall or 0), detail
    if case.stderr_has is not None:
        assert case.stderr_has in bad.stderr_tail, detail
    assert elapsed < 240, elapsed

    # The siblings: correct results, untouched by their neighbour.
    for i, sibling in enumerate(siblings):
        assert sibling.ok, outcome_text(sibling)
        assert sibling.result == sibling_expected(i)
        assert FAKE_TOKEN not in sibling.stdout_tail and "token ***" in sibling.stdout_tail

    # The orchestrator kept its memory and descriptors; the server is up.
    rss1, fds1 = rss_and_fds()
    assert fds1 <= fds0 + FD_SLACK, (fds0, fds1)
    assert rss1 - rss0 < RSS_SLACK_KB, (rss0, rss1)
    assert rel_server.running()

    # Nothing of any of the three sandboxes is left on the host.
    assert len(recorder.traces) == 3
    for trace in recorder.traces:
        assert trace.bwrap_pid is not None
        assert host.wait_clean(trace, (marker,)) == [], trace
    assert client.sandboxes.list() == []

    # No secret in any outcome or log line.
    for outcome in outcomes:
        assert secret_free(outcome_text(outcome), rel_server.api_key, CANARY_VALUE) == []
    assert secret_free(caplog.text, rel_server.api_key, CANARY_VALUE) == []


def test_state_never_survives_into_the_next_job(rel_server: Any, host: Any, client: Any, warm: None) -> None:
    """A job leaves a background process, a changed template file, files and env settings;
    the next job, in a fresh sandbox, sees none of it."""
    marker = f"{9000 + os.getpid() % 900}.{uuid.uuid4().int % 10**6}"
    dirty = f"""
import json, os, subprocess, time
subprocess.Popen(["sleep", "{marker}"], start_new_session=True)
open("{TEMPLATE_FILE}", "w").write("poisoned")
for path in ("/tmp/leftover", "/work/leftover", "/var/tmp/leftover"):
    open(path, "w").write("x" * 1000)
for rc in ("/root/.profile", "/root/.bashrc", "/etc/environment"):
    open(rc, "a").write("export LEAKED_VAR=poison\\n")
os.environ["LEAKED_VAR"] = "poison"
print("background started", flush=True)
time.sleep(1.5)
json.dump({{"left": "everything"}}, open(os.environ["JOB_RESULT"], "w"))
"""
    check = f"""
import json, os
mine, pid = set(), os.getpid()  # this job's own chain: its shell carries this script
while pid > 1:
    mine.add(str(pid))
    pid = int(open(f"/proc/{{pid}}/stat", "rb").read().rsplit(b")", 1)[1].split()[1])
cmdlines = []
for pid in (p for p in os.listdir("/proc") if p.isdigit() and p not in mine):
    try:
        cmdlines.append(open(f"/proc/{{pid}}/cmdline", "rb").read().replace(b"\\0", b" ").decode())
    except OSError:
        pass
json.dump({{
    "procs": [c for c in cmdlines if "{marker}" in c],
    "template_file": open("{TEMPLATE_FILE}").read(),
    "leftovers": [p for p in ("/tmp/leftover", "/work/leftover", "/var/tmp/leftover",
                              "/root/.profile", "/root/.bashrc", "/etc/environment") if os.path.exists(p)],
    "env": os.environ.get("LEAKED_VAR"),
    "login_env": os.popen("sh -lc 'echo ${{LEAKED_VAR:-clean}}'").read().strip(),
}}, open(os.environ["JOB_RESULT"], "w"))
"""
    seen_on_host: list[bool] = []

    def watch(stream: str, chunk: str) -> None:
        if "background started" in chunk:
            seen_on_host.append(bool(pids_matching(f"sleep {marker}")))

    recorder = Recorder(host)
    first = run_job(
        client,
        JobSpec(command="python3 dirty.py", files={"dirty.py": dirty}, template=TEMPLATE, timeout=60),
        on_created=recorder,
        on_output=watch,
    )
    assert first.ok and first.result == {"left": "everything"}, outcome_text(first)
    # The background process really ran on the host while the sandbox lived (so the checks can fail)...
    # (under gVisor a job's processes are the sentry's, not host processes: the check below is
    # then the sandbox's own runsc processes, through the recorder's traces)
    assert seen_on_host == [not GVISOR]
    # ...and is gone with the sandbox.
    assert host.wait_clean(recorder.traces[0], (f"sleep {marker}",)) == []

    second = run_job(
        client,
        JobSpec(command="python3 check.py", files={"check.py": check}, template=TEMPLATE, timeout=60),
        on_created=recorder,
    )
    assert second.ok, outcome_text(second)
    assert second.result == {
        "procs": [],
        "template_file": TEMPLATE_FILE_TEXT,
        "leftovers": [],
        "env": None,
        "login_env": "clean",
    }
    assert recorder.traces[0].sandbox_id != recorder.traces[1].sandbox_id
    assert host.wait_clean(recorder.traces[1]) == []


def test_escape_and_snooping_find_nothing(
    rel_server: Any,
    rel_templates: Path,
    host: Any,
    client: Any,
    warm: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Read the orchestrator's env and key, Airflow/Prefect homes, host files, other sandboxes'
    files, host /proc; connect to the server, the orchestrator APIs and the internet; write
    outside; kill host processes. Every probe fails; the host confirms from its side."""
    caplog.set_level(logging.DEBUG)
    token = uuid.uuid4().hex[:12]
    airflow_api, prefect_api = FakeListener(), FakeListener()
    host_secret = Path(f"/tmp/ps-rel-host-secret-{token}")
    host_secret.write_text("host secret")
    outside = [
        f"/tmp/ps-rel-escape-{token}",
        str(Path(rel_server.state_dir) / f"escape-{token}"),
        f"/usr/lib/ps-rel-escape-{token}",
        str(Path.home() / f"ps-rel-escape-{token}"),
    ]
    recorder = Recorder(host)
    rss0, fds0 = rss_and_fds()
    try:
        with ThreadPoolExecutor(1) as pool:
            sibling_future = pool.submit(
                run_job,
                client,
                JobSpec(
                    command=f"python3 sibling.py {token} 20",
                    files={"sibling.py": SIBLING_WITH_SECRET},
                    template=TEMPLATE,
                    timeout=60,
                ),
                on_created=recorder,
            )
            sibling_id = wait_for(
                "sibling",
                lambda: recorder.traces and recorder.traces[0].sandbox_id,
                timeout=60,
                interval=0.05,
            )
            sibling_sb = client.sandboxes.get(sibling_id)
            wait_for(
                "sibling secret",
                lambda: sibling_sb.filesystem.exists(f"/work/secret-{token}"),
                timeout=60,
                interval=0.05,
            )
            ip = host_ip()
            cfg = {
                "markers": [CANARY_NAME, "PANDASTACK", "AIRFLOW", "PREFECT", "pds_"],
                # Host facts a sandbox must not learn from any /proc cmdline or environ.
                "host_words": [
                    str(rel_server.state_dir),
                    str(rel_templates),
                    "pytest",
                    "pandastack_local",
                    "/sys/fs/cgroup",
                    rel_server.url,
                ],
                "host_env_words": ["PS_CGROUPS", f"PWD={os.getcwd()}"],
                "read_paths": [
                    os.environ.get("AIRFLOW_HOME", "/root/airflow"),
                    os.environ.get("PREFECT_HOME", str(Path.home() / ".prefect")),
                    str(Path.home() / ".prefect"),
                    str(rel_server.state_dir),
                    str(Path(rel_server.state_dir) / "server.log"),
                    str(Path(rel_server.state_dir) / "sandboxes" / sibling_id),
                    str(host_secret),
                    f"/proc/{rel_server.pid}/environ",
                    f"/proc/{os.getpid()}/environ",
                    "/etc/shadow",
                    "/home",
                ],
                "sibling_token": token,
                "tcp": [
                    ["127.0.0.1", rel_server.port],
                    ["127.0.0.1", airflow_api.port],
                    ["127.0.0.1", prefect_api.port],
                    *[["127.0.0.1", p] for p in (8080, 8793, 4200, 5432, 6379)],
                    *([[ip, airflow_api.port], [ip, prefect_api.port], [ip, 22]] if ip else []),
                    ["1.1.1.1", 53],
                    ["8.8.8.8", 443],
                ],
                "write_paths": outside,
                "kill_pids": [os.getpid(), rel_server.pid, os.getppid()],
            }
            probe = run_job(
                client,
                JobSpec(
                    command="python3 probe.py",
                    files={"probe.py": ESCAPE_PROBE},
                    input=cfg,
                    template=TEMPLATE,
                    timeout=60,
                ),
                on_created=recorder,
            )
            sibling = sibling_future.result(timeout=120)
        detail = outcome_text(probe)
        assert probe.ok, detail
        seen = probe.result
        assert seen["env_markers"] == [], detail
        assert secret_free(seen["env_text"], rel_server.api_key, CANARY_VALUE) == []
        assert seen["pid_count"] < 10, detail
        assert seen["host_cmdlines"] == [], detail
        assert seen["host_env"] == [], detail
        assert seen["readable"] == [], detail
        assert seen["sibling_files"] == [], detail
        assert seen["connected"] == [], detail
        assert seen["killed"] == [], detail
        # The host side: nothing connected, nothing written outside, everyone alive.
        assert airflow_api.accepted() == 0 and prefect_api.accepted() == 0
        assert [p for p in outside if Path(p).exists()] == []
        assert host_secret.read_text() == "host secret"
        assert rel_server.running()
        assert sibling.ok and sibling.result == {"sibling": "ok"}, outcome_text(sibling)
        rss1, fds1 = rss_and_fds()
        assert fds1 <= fds0 + FD_SLACK and rss1 - rss0 < RSS_SLACK_KB
        for trace in recorder.traces:
            assert host.wait_clean(trace) == []
        for outcome in (probe, sibling):
            assert secret_free(outcome_text(outcome), rel_server.api_key, CANARY_VALUE) == []
        assert secret_free(caplog.text, rel_server.api_key, CANARY_VALUE) == []
    finally:
        airflow_api.close()
        prefect_api.close()
        host_secret.unlink()
        for path in outside:
            if Path(path).is_file():
                Path(path).unlink()


def test_the_guard_rails_can_fail(rel_server: Any, host: Any, client: Any) -> None:
    """Sanity for the matrix: the same probes succeed where nothing stops them, so the
    assertions above are not vacuous (a live sandbox shows up in every leftover check, the
    canary is in the server's environment, the fake API counts a host connection)."""
    sb = client.sandboxes.create(template=TEMPLATE)
    try:
        trace = host.trace(sb.id)
        live = host.leftovers(trace)
        assert any("bwrap process" in p for p in live) and any("host dir" in p for p in live), live
        if Path("/sys/fs/cgroup/memory").is_dir() or Path("/sys/fs/cgroup/cgroup.controllers").exists():
            assert any("cgroup" in p for p in live), live
    finally:
        sb.kill()
    assert host.wait_clean(trace) == []
    assert os.environ[CANARY_NAME] == CANARY_VALUE
    assert CANARY_VALUE.encode() in Path(f"/proc/{rel_server.pid}/environ").read_bytes()
    listener = FakeListener()
    try:
        import socket

        socket.create_connection(("127.0.0.1", listener.port), timeout=2).close()
        assert wait_for("a host connection", listener.accepted, timeout=5, interval=0.05) == 1
    finally:
        listener.close()
