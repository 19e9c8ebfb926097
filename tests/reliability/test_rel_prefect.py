"""A representative subset of the hostile matrix, and a 200-job soak, through the Prefect task
(``run_in_sandbox`` in real flows on an ephemeral Prefect API). Runs in ``.venv-prefect`` only."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

pytest.importorskip("prefect.testing.utilities")

from prefect import flow, unmapped

from pandastack_local.testing.procs import rss_and_fds
from prefect_blocks import PandaStackCredentials, PandaStackSandbox, SandboxJobFailed, run_in_sandbox
from tests.reliability.catalogue import (
    CANARY_VALUE,
    ESCAPE_PROBE,
    FAKE_TOKEN,
    HOSTILE,
    SIBLING_JOB,
    TEMPLATE,
    hostile_files,
    sibling_expected,
    sibling_rows,
)
from tests.reliability.probes import secret_free
from tests.support.prefect_fixtures import fast_redelivery, prefect_api
from tests.support.prefect_readback import artifacts_text, flow_run_id, logs, task_runs

pytestmark = pytest.mark.reliability
__all__ = ["fast_redelivery", "prefect_api"]  # fixtures, used by name

SUBSET = ["decompression_bomb", "threads", "exponential_regex", "fill_tmp", "open_files", "kill_everything"]


@pytest.fixture
def block(rel_server: Any) -> PandaStackSandbox:
    credentials = PandaStackCredentials(api_url=rel_server.url, api_key=rel_server.api_key)
    return PandaStackSandbox(credentials=credentials, template=TEMPLATE, timeout=90)


def sibling(i: int, sandbox: PandaStackSandbox) -> Any:
    """Submit the well-behaved sibling (inside a flow); returns its future."""
    files = {"sibling.py": SIBLING_JOB}
    return run_in_sandbox.submit(
        "python3 sibling.py", files, {"rows": sibling_rows(i)}, sandbox=sandbox, job_name=f"sibling-{i}"
    )


def failure_of(future: Any) -> dict[str, str] | None:
    """The job's failure as the task raised it (None if it succeeded)."""
    try:
        future.result()
    except SandboxJobFailed as exc:
        return {"kind": exc.kind.value, "class": "redeliver" if exc.redeliver else "dead_letter"}
    return None


def prefect_api_port() -> int:
    from prefect.settings import PREFECT_API_URL

    return urlparse(PREFECT_API_URL.value()).port or 0


@pytest.fixture(scope="module")
def warm(rel_server: Any) -> None:
    """One flow of the same shape first: Prefect's API clients, log and event workers and the task
    thread pool start on first use, so later fd/RSS deltas are the job's, not Prefect's start-up."""
    credentials = PandaStackCredentials(api_url=rel_server.url, api_key=rel_server.api_key)
    quiet = PandaStackSandbox(credentials=credentials, template=TEMPLATE, timeout=90)

    @flow
    def warm_flow() -> list[Any]:
        futures = [sibling(i, quiet) for i in range(len(SUBSET) + 2)]
        return [f.result() for f in futures]

    assert warm_flow() == [sibling_expected(i) for i in range(len(SUBSET) + 2)]


def test_prefect_hostile_subset_fails_alone(rel_server: Any, block: PandaStackSandbox, warm: None) -> None:
    names = SUBSET

    @flow
    def hostile_flow() -> dict[str, Any]:
        before = sibling(0, block)
        bad = {
            name: run_in_sandbox.with_options(retries=0).submit(
                "python3 job.py",
                hostile_files(HOSTILE[name]),
                sandbox=block,
                timeout=HOSTILE[name].timeout,
                job_name=name,
            )
            for name in names
        }
        after = sibling(1, block)
        out: dict[str, Any] = {"before": before.result(), "after": after.result()}
        for name, future in bad.items():
            out[name] = failure_of(future)
        return out

    # Each job's SDK client (a requests session in a reference cycle) keeps its pooled socket until
    # the cyclic GC runs: collected first, so the counts are what the orchestrator still holds.
    gc.collect()
    usage_before = rss_and_fds()
    state = hostile_flow(return_state=True)
    gc.collect()
    usage_after = rss_and_fds()
    assert state.is_completed(), state.message
    out = state.result()
    assert out["before"] == sibling_expected(0) and out["after"] == sibling_expected(1)
    for name in names:
        assert out[name] == {
            "kind": HOSTILE[name].expected_kind.value,
            "class": HOSTILE[name].failure_class.value,
        }, (
            name,
            out[name],
        )

    flow_run = flow_run_id(state)
    text = logs(flow_run) + artifacts_text(flow_run)
    assert secret_free(text, rel_server.api_key, CANARY_VALUE) == []
    assert FAKE_TOKEN not in text and "token ***" in text
    assert usage_after[1] <= usage_before[1] + 4, (usage_before, usage_after)
    assert usage_after[0] - usage_before[0] < 200 * 1024, (usage_before, usage_after)
    assert rel_server.client().sandboxes.list() == []


def test_prefect_redeliver_retries_and_dead_letter_does_not(block: PandaStackSandbox) -> None:
    @flow
    def classes_flow() -> Any:
        timed_out = run_in_sandbox.with_options(retries=1).submit(
            "python3 -c 'while True: pass'", sandbox=block, timeout=2, job_name="hot-loop"
        )
        bomb = run_in_sandbox.with_options(retries=3).submit(
            "python3 job.py", hostile_files(HOSTILE["result_bomb"]), sandbox=block, job_name="result-bomb"
        )
        return failure_of(timed_out), failure_of(bomb)

    state = classes_flow(return_state=True)
    assert state.result() == (
        {"kind": "timeout", "class": "redeliver"},
        {"kind": "result_too_large", "class": "dead_letter"},
    )
    runs = task_runs(flow_run_id(state))
    assert sorted(r.run_count for r in runs) == [1, 2], [(r.name, r.run_count) for r in runs]
    assert "result-bomb-dead-letter" in artifacts_text(flow_run_id(state))


def test_prefect_escape_probe_finds_nothing(rel_server: Any, block: PandaStackSandbox) -> None:
    cfg = {
        "markers": ["PS_RELIABILITY", "PANDASTACK", "PREFECT", "pds_"],
        "host_words": [str(rel_server.state_dir), "pytest", "pandastack_local", "prefect.server"],
        "host_env_words": [f"PWD={os.getcwd()}"],
        "read_paths": [
            os.environ.get("PREFECT_HOME", str(Path.home() / ".prefect")),
            str(Path.home() / ".prefect"),
            str(rel_server.state_dir),
        ],
        "sibling_token": "no-sibling-here",
        "tcp": [["127.0.0.1", rel_server.port], ["127.0.0.1", prefect_api_port()], ["1.1.1.1", 53]],
        "write_paths": [f"/tmp/ps-rel-prefect-escape-{os.getpid()}"],
        "kill_pids": [os.getpid(), rel_server.pid],
    }

    @flow
    def escape_flow() -> Any:
        return run_in_sandbox("python3 probe.py", {"probe.py": ESCAPE_PROBE}, cfg, sandbox=block)

    state = escape_flow(return_state=True)
    assert state.is_completed(), state.message
    seen = state.result()
    for key in ("env_markers", "host_cmdlines", "host_env", "readable", "connected", "killed"):
        assert seen[key] == [], (key, seen[key])
    assert secret_free(seen["env_text"], rel_server.api_key, CANARY_VALUE) == []
    assert not Path(cfg["write_paths"][0]).exists()
    text = logs(flow_run_id(state)) + artifacts_text(flow_run_id(state))
    assert secret_free(text, rel_server.api_key, CANARY_VALUE) == []


SOAK_TOTAL = 200
# Prefect's thread-pool task runner has no worker cap by default: a flow of 200 mapped tasks grows
# the pool (threads, per-thread API clients) to its full width once. The warm-up is therefore a
# flow of the same width; measured on this machine: +12% over a 20-wide warm-up, then +1% and
# +0.3% for the next two 200-wide flows (a plateau, not a leak).
SOAK_WARMUP = SOAK_TOTAL
SOAK_JOB = 'n=$(cat "$JOB_INPUT"); echo "{\\"n\\": $n, \\"square\\": $((n * n))}" > "$JOB_RESULT"\n'


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_prefect_soak_200_jobs(rel_server: Any, block: PandaStackSandbox) -> None:
    quiet = block.model_copy(update={"publish_artifacts": False})

    @flow
    def soak_flow(count: int) -> list[Any]:
        futures = run_in_sandbox.map(
            unmapped("sh job.sh"),
            unmapped({"job.sh": SOAK_JOB}),
            list(range(count)),
            sandbox=unmapped(quiet),
        )
        return [f.result() for f in futures]

    assert soak_flow(SOAK_WARMUP) == [{"n": n, "square": n * n} for n in range(SOAK_WARMUP)]
    gc.collect()
    rss_warm, fds_warm = rss_and_fds()
    assert soak_flow(SOAK_TOTAL) == [{"n": n, "square": n * n} for n in range(SOAK_TOTAL)]
    gc.collect()
    rss_end, fds_end = rss_and_fds()
    assert rss_end < rss_warm * 1.05, (rss_warm, rss_end)
    assert fds_end <= fds_warm + 4, (fds_warm, fds_end)
    assert rel_server.client().sandboxes.list() == []
