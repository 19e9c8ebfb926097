"""A worker process for the SIGKILL fault: runs one job through the core and prints what it delivers.

Usage: ``python rel_worker.py <run id> <try number>`` with ``PANDASTACK_API`` and
``PANDASTACK_API_KEY`` in the environment (never on the command line).
"""

from __future__ import annotations

import json
import os
import sys

from pandastack_jobs import ConnectionConfig, JobKey, JobSpec, run_job

# The job: announce, work for a while, write the result. Same code on every try.
JOB = "echo started; sleep 4; echo '{\"delivered_by\": \"'$JOB_TRY'\"}' > result.json"


def spec(run: str, try_number: int) -> JobSpec:
    return JobSpec(
        command=JOB,
        template="hostile",
        timeout=60,
        env={"JOB_TRY": str(try_number)},
        key=JobKey("core", "reliability-worker", "victim", run, try_number=try_number),
    )


if __name__ == "__main__":
    run, try_number = sys.argv[1], int(sys.argv[2])
    client = ConnectionConfig(
        api_url=os.environ["PANDASTACK_API"], api_key=os.environ["PANDASTACK_API_KEY"]
    ).client()
    outcome = run_job(
        client,
        spec(run, try_number),
        on_created=lambda sid: print("CREATED", sid, flush=True),
        on_output=lambda stream, chunk: print("OUTPUT", stream, chunk.strip(), flush=True),
    )
    if outcome.ok:
        print("DELIVERED", json.dumps(outcome.result), flush=True)
    else:
        print("FAILED", outcome.kind, outcome.reason, flush=True)
