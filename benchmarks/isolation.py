"""(2) Isolation cost: the same job as a subprocess of a shared worker vs one sandbox per job.

Run: ``python -m benchmarks.isolation [--rounds R --batch B]``. The shared worker
is the usual "before" picture: one long-lived process that runs each job as a
child process in a scratch directory (no namespaces, no limits, no clean-up
guarantee). The sandbox side is ``pandastack_jobs.run_job`` on pandastack-local.
Both run the same interpreter (``/usr/bin/python3``, which the template binds).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import common  # the one job every benchmark runs (common.JOB_CODE, ...)
from benchmarks.common import interleaved, log, machine, ratio, summary, write_json
from benchmarks.options import int_options
from benchmarks.overhead import core_job

PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else shutil.which("python3") or "python3"


def shared_worker_job() -> Any:
    """Deliver, run under a timeout, read back, scrub: all in the worker's own kernel namespace."""
    work = Path(tempfile.mkdtemp(prefix="bench-job-"))
    try:
        (work / "input.json").write_text(json.dumps(common.JOB_INPUT))
        (work / "run.py").write_text(common.JOB_CODE)
        env = {
            "JOB_INPUT": str(work / "input.json"),
            "JOB_RESULT": str(work / "result.json"),
            "PATH": "/usr/bin:/bin",
        }
        proc = subprocess.run(
            [PYTHON, "run.py"],
            cwd=work,
            env=env,
            timeout=common.JOB_TIMEOUT,
            capture_output=True,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.decode()[-1000:])
        result = json.loads((work / "result.json").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert result == common.EXPECTED, result
    return result


def main() -> None:
    args = int_options(rounds=4, batch=10)
    from pandastack_local import LocalServer

    with LocalServer() as server:
        client = server.client()
        variants = {"shared_worker": shared_worker_job, "sandbox_per_job": lambda: core_job(client)}
        log(f"isolation: {args.rounds} rounds x {args.batch} jobs x 2 variants")
        samples = interleaved(variants, args.rounds, args.batch)
    shared, sandbox = summary(samples["shared_worker"]), summary(samples["sandbox_per_job"])
    data = {
        "machine": machine(),
        "python_in_both": PYTHON,
        "shared_worker": shared,
        "sandbox_per_job": sandbox,
        "ratio_p50": ratio(sandbox["p50_ms"], shared["p50_ms"]),
        "ratio_mean": ratio(sandbox["mean_ms"], shared["mean_ms"]),
        "extra_ms_p50": round(sandbox["p50_ms"] - shared["p50_ms"], 2),
        "extra_ms_p99": round(sandbox["p99_ms"] - shared["p99_ms"], 2),
    }
    log(f"isolation written to {write_json('isolation', data)}")


if __name__ == "__main__":
    main()
