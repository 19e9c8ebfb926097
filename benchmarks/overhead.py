"""(1) Integration overhead: the same small job via the raw SDK, the core and the Airflow operator.

Run in ``.venv-airflow``: ``python -m benchmarks.overhead [--rounds R --batch B]``.
(a) is a hand-written loop on the ``pandastack`` SDK doing the five steps of one job (create,
write two files, exec, read, delete); (b) is ``pandastack_jobs.run_job``; (c) is
``PandaStackSandboxOperator.execute``
called directly with a minimal context (see :class:`BenchTaskInstance`). Batches
of the three are interleaved with a rotating order so drift hits all of them.
The Prefect task (d) lives in :mod:`benchmarks.prefect_overhead` (other venv).
"""

from __future__ import annotations

import json
import os
import statistics
import uuid
from collections.abc import Callable
from typing import Any

import pandastack

from benchmarks import common  # the one job every benchmark runs (common.JOB_CODE, ...)
from benchmarks.common import interleaved, log, machine, ratio, summary, write_json
from benchmarks.options import int_options

TTL = common.JOB_TIMEOUT + 60


def raw_sdk_job(client: pandastack.Client) -> Any:
    """(a) The plain SDK loop, by hand: create → write two files → exec → read → delete in ``finally``."""
    sb = client.sandboxes.create(
        template=common.TEMPLATE, ttl_seconds=TTL, metadata={"job_id": uuid.uuid4().hex}
    )
    try:
        sb.filesystem.write("/work/input.json", json.dumps(common.JOB_INPUT).encode())
        sb.filesystem.write("/work/run.py", common.JOB_CODE.encode())
        r = sb.exec("cd /work && python3 run.py", timeout_seconds=common.JOB_TIMEOUT)
        if r.exit_code != 0:
            raise RuntimeError(r.stderr[-1000:])
        result = json.loads(sb.filesystem.read("/work/result.json"))
    finally:
        client.sandboxes.delete(sb.id)
    assert result == common.EXPECTED, result
    return result


def core_job(client: pandastack.Client) -> Any:
    """(b) The same job through the core's one lifecycle (no JobKey: no orphan reaping)."""
    from pandastack_jobs import JobSpec, run_job

    outcome = run_job(client, JobSpec(**common.JOB_OPTIONS))
    assert outcome.ok and outcome.result == common.EXPECTED, outcome.reason
    return outcome.result


class BenchTaskInstance:
    """The part of a RuntimeTaskInstance the operator touches: ids, try number, ``xcom_push``.

    No scheduler, no metadata DB and no task-runner supervisor are involved: those are
    engine costs paid by every operator, not by this integration. XComs land in a dict.
    """

    dag_id = "bench_overhead"
    task_id = "job"
    map_index = -1
    try_number = 1

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.xcoms: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcoms[key] = value


def airflow_variant(url: str, api_key: str) -> Callable[[], Any]:
    """(c) One operator instance; each call is a new task try of a new DAG run."""
    os.environ["AIRFLOW_CONN_PANDASTACK_DEFAULT"] = json.dumps(
        {"conn_type": "pandastack", "host": url, "password": api_key}
    )
    from airflow_provider.operators.sandbox import PandaStackSandboxOperator

    operator = PandaStackSandboxOperator(task_id="job", **common.JOB_OPTIONS)

    def run() -> Any:
        ti = BenchTaskInstance(run_id=f"bench__{uuid.uuid4().hex}")
        result = operator.execute({"ti": ti})  # type: ignore[arg-type]
        assert result == common.EXPECTED and ti.xcoms["pandastack"]["ok"], result
        return result

    return run


def paired(values: list[float], base: list[float], batch: int) -> float:
    """The median over rounds of one round's ratio (its batch's median over ``base``'s batch in
    the same round): each ratio is taken under the same moment's load."""
    rounds = [
        statistics.median(values[i : i + batch]) / statistics.median(base[i : i + batch])
        for i in range(0, min(len(values), len(base)), batch)
    ]
    return round(statistics.median(rounds), 3) if rounds else float("nan")


def report(samples: dict[str, list[float]], base: str, batch: int = 1) -> dict[str, Any]:
    """Per-variant summaries and each variant's p50/p99 ratio to ``base`` (and the median of
    its per-round ratios, ``paired``)."""
    out: dict[str, Any] = {name: summary(values) for name, values in samples.items()}
    b = out[base]
    out["ratios"] = {
        f"{name}/{base}": {
            "p50": ratio(out[name]["p50_ms"], b["p50_ms"]),
            "mean": ratio(out[name]["mean_ms"], b["mean_ms"]),
            "p99": ratio(out[name]["p99_ms"], b["p99_ms"]),
            "paired": paired(samples[name], samples[base], batch),
        }
        for name in samples
        if name != base
    }
    return out


def main() -> None:
    from pandastack_local import LocalServer

    args = int_options(rounds=6, batch=10)
    with LocalServer() as server:
        client = server.client()  # one client for every job, as a worker has
        airflow = airflow_variant(server.url, server.api_key)
        variants = {
            "a_raw_sdk": lambda: raw_sdk_job(client),
            "b_core": lambda: core_job(client),
            "c_airflow": airflow,
        }
        log(f"overhead: {args.rounds} rounds x {args.batch} jobs x {len(variants)} variants")
        samples = interleaved(variants, args.rounds, args.batch)
        assert client.sandboxes.list() == [], "a variant leaked a sandbox"
    data = {
        "machine": machine(),
        "n_per_variant": args.rounds * args.batch,
        "rounds": args.rounds,
        "batch": args.batch,
        **report(samples, "a_raw_sdk", args.batch),
        "samples_ms": {k: [round(v * 1000, 2) for v in vs] for k, vs in samples.items()},
    }
    log(f"overhead written to {write_json('overhead', data)}")


if __name__ == "__main__":
    main()
