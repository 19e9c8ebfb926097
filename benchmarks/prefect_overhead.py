"""(1d) Integration overhead of the Prefect task, measured against its own raw-SDK baseline.

Run in ``.venv-prefect`` (Prefect and Airflow cannot share a venv):
``python -m benchmarks.prefect_overhead --out FILE``. The driver starts it as a
subprocess and reads the JSON back. Prefect's API server is a temporary one
(``prefect_test_harness``) started before timing begins; every ``run_in_sandbox``
call is a real task run inside one flow run (state changes, events, artifacts).
Batches of (a) the raw-SDK loop called plainly, (t) a plain ``@task`` running the same raw
loop (Prefect's own per-task cost, paid by any task) and (d) the task alternate inside that
flow, so d/t (the target: what the adapter and the core add over a plain Prefect task) and
d/a are ratios measured in the same process under the same drift.
"""

from __future__ import annotations

import json
from typing import Any

from benchmarks.common import EXPECTED, JOB_CODE, JOB_INPUT, JOB_TIMEOUT, interleaved, log, machine
from benchmarks.options import int_options
from benchmarks.overhead import raw_sdk_job, report
from benchmarks.prefect_harness import prefect_server


def measure(rounds: int, batch: int) -> dict[str, list[float]]:
    from prefect import flow, task

    from pandastack_local import LocalServer
    from prefect_blocks import PandaStackCredentials, run_in_sandbox

    with LocalServer() as server:
        client = server.client()
        credentials = PandaStackCredentials(api_url=server.url, api_key=server.api_key)

        def task_job() -> Any:
            result = run_in_sandbox(
                "python3 run.py",
                files={"run.py": JOB_CODE},
                input=JOB_INPUT,
                credentials=credentials,
                timeout=JOB_TIMEOUT,
            )
            assert result == EXPECTED, result
            return result

        @task(name="raw-sdk-loop")
        def raw_task() -> Any:
            return raw_sdk_job(client)

        @flow(name="bench-overhead", log_prints=False)
        def bench() -> dict[str, list[float]]:
            variants = {
                "a_raw_sdk": lambda: raw_sdk_job(client),
                "t_raw_task": lambda: raw_task(),
                "d_prefect": task_job,
            }
            return interleaved(variants, rounds, batch)

        samples = bench()
        assert client.sandboxes.list() == [], "a variant leaked a sandbox"
    return samples


def main() -> None:
    args = int_options(out=True, rounds=6, batch=10)
    with prefect_server(120):
        log(f"prefect overhead: {args.rounds} rounds x {args.batch} jobs x 2 variants (server up)")
        samples = measure(args.rounds, args.batch)
    data = {
        "machine": machine(),
        "n_per_variant": args.rounds * args.batch,
        "batch": args.batch,
        **report(samples, "a_raw_sdk", args.batch),
        "ratios_to_task": report(samples, "t_raw_task", args.batch)["ratios"],
        "samples_ms": {k: [round(v * 1000, 2) for v in vs] for k, vs in samples.items()},
    }
    args.out.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
