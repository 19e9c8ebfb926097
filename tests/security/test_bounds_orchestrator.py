"""Every byte the host reads from a sandbox is bounded on the orchestrator's side too: a job that
prints gigabytes does not grow the memory of the process that runs it (an Airflow worker, a
Prefect worker, a queue consumer), whatever the SDK would keep.

The orchestrator is a child process running the core's ``run_job`` through the real SDK against
the suite's real server; its RSS is watched from /proc (bounds_support.RssWatch, whose watchdog
kills the child, never this test process, if the bound fails badly).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

from pandastack_jobs import JobSpec, finish_detached
from pandastack_jobs.detached import OUTPUT_TAIL_BYTES
from pandastack_jobs.spec import TAIL_BYTES
from pandastack_local import LocalServer

from .bounds_support import RSS_GROWTH_LIMIT, MiB, RssWatch, client_fixture, detached_started, server_fixture  # noqa: F401

# Of "y\n" on stdout: four times the bound, so an orchestrator that kept what it was sent would
# pass the bound four times over. It was 1 GiB (sixteen times): the same outcome, but 143 s under
# gVisor on a loaded machine, for bytes that prove nothing more.
PRINTED = 256 * MiB
CLOSING = "the-last-line-of-the-job"

ORCHESTRATOR = textwrap.dedent(
    """
    import json, os, sys
    import pandastack
    from pandastack_jobs import JobSpec, run_job

    client = pandastack.Client(api_url=os.environ["PS_URL"], api_key=os.environ["PS_KEY"])
    spec = JobSpec(command=sys.argv[1], template="small", timeout=240)
    seen = {"stdout": 0, "stderr": 0}

    def on_output(stream, chunk):
        seen[stream] += len(chunk)

    print("ready", flush=True)
    sys.stdin.readline()
    outcome = run_job(client, spec, on_output=on_output)
    print(json.dumps({
        "exit_code": outcome.exit_code, "ok": outcome.ok, "reason": outcome.reason,
        "stdout_tail": outcome.stdout_tail, "stderr_tail": outcome.stderr_tail, "seen": seen,
    }), flush=True)
    sys.stdin.readline()  # stay alive until the watch has read the peak
    """
)


def test_gigabytes_of_stdout_do_not_grow_the_orchestrator(server: LocalServer) -> None:
    command = f"yes | head -c {PRINTED}; echo {CLOSING}; echo to-stderr >&2; exit 3"
    env = {**os.environ, "PS_URL": server.url, "PS_KEY": server.api_key}
    with subprocess.Popen(
        [sys.executable, "-c", ORCHESTRATOR, command],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    ) as child:
        assert child.stdin is not None and child.stdout is not None
        try:
            assert child.stdout.readline().strip() == "ready"  # imports done: the baseline is the run's
            with RssWatch(child.pid) as watch:
                child.stdin.write("go\n")
                child.stdin.flush()
                report_line = child.stdout.readline()
            if child.poll() is None:  # not killed by the watchdog: let it exit
                with contextlib.suppress(BrokenPipeError):
                    child.stdin.write("bye\n")
                    child.stdin.flush()
                child.wait(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
    assert not watch.killed, f"the orchestrator's RSS grew past {watch.ceiling // MiB} MiB: killed"
    assert watch.growth < RSS_GROWTH_LIMIT, (
        f"the orchestrator's RSS grew by {watch.growth / MiB:.0f} MiB for {PRINTED // MiB} MiB printed"
    )
    report = json.loads(report_line)
    assert report["exit_code"] == 3 and not report["ok"], report["reason"]
    assert report["seen"]["stdout"] == PRINTED + len(CLOSING) + 1  # every chunk still reached the log
    assert report["stdout_tail"].endswith(f"y\ny\n{CLOSING}\n")
    assert 0 < len(report["stdout_tail"]) <= TAIL_BYTES
    assert report["stderr_tail"] == "to-stderr\n"


def test_a_detached_jobs_output_is_read_back_as_a_tail_not_whole(server: LocalServer, client: Any) -> None:
    """A detached job's captured stdout of 24 MiB (under the server's 32 MiB read cap): finishing
    the job reads its last 64 KiB, not the whole file (on main: all 24 MiB, twice over as text)."""
    printed = 24 * MiB
    spec = JobSpec(
        command=f"yes | head -c {printed}; echo {CLOSING}", template="small", timeout=60, result_path=None
    )
    job = detached_started(client, spec, timeout=60)
    chunks: dict[str, list[str]] = {"stdout": [], "stderr": []}
    with RssWatch(os.getpid(), ceiling=256 * MiB) as watch:  # the server caps reads at 32 MiB
        outcome = finish_detached(client, spec, job, on_output=lambda s, c: chunks[s].append(c))  # type: ignore[arg-type]
    assert outcome.ok, outcome.summary()
    assert watch.growth < 8 * MiB, f"finishing grew this process by {watch.growth / MiB:.0f} MiB"
    assert [len(c) for c in chunks["stdout"]] == [OUTPUT_TAIL_BYTES]
    assert chunks["stdout"][0].endswith(f"y\ny\n{CLOSING}\n")
    assert outcome.stdout_tail.endswith(f"y\n{CLOSING}\n")
