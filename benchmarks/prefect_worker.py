"""(issue 18 item 7, issue 27 item 3) Flow-run overhead of the ``pandastack`` worker, cold and warm,
against the ``process`` worker.

Run in ``.venv-prefect``: ``python -m benchmarks.prefect_worker --out FILE``. One temporary
Prefect API (``prefect_test_harness``), one pandastack-local with a ``prefect`` template
(this venv + the flow's directory, egress to the API only), a ``process`` pool, a cold
``pandastack`` pool and a ``pandastack`` pool with ``warm_pool_size=1``, the same trivial flow
deployed to each, one long-lived worker per pool. Each sample is one flow run from the worker's
poll to the run's final state (Completed), measured by the client; the kinds rotate each round,
so the ratios are taken under the same machine drift. Prefect's own ``start_time``/``end_time``
of each run is recorded too. A warm sample waits (untimed) until a standby is ready, and counts
as a hit only if the run's sandbox was that standby; the wait and the first fill are reported,
and one waiting runner's RSS/PSS as the standby's memory cost.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from benchmarks.common import log, machine, ratio, summary
from benchmarks.options import int_options
from benchmarks.prefect_harness import prefect_server

FLOW = """
from prefect import flow


@flow(name="bench-trivial")
def trivial() -> int:
    return 1
"""


async def one_run(worker: Any, client: Any, deployment: str) -> tuple[float, float, str]:
    """(wall seconds from poll to Completed, Prefect's own run time, infrastructure pid)."""
    import anyio
    from prefect.deployments import run_deployment

    fr = await run_deployment(deployment, timeout=0)
    started = time.perf_counter()
    await worker.get_and_submit_flow_runs()
    while True:
        current = await client.read_flow_run(fr.id)
        if current.state is not None and current.state.is_final():
            wall = time.perf_counter() - started
            break
        await anyio.sleep(0.05)
    assert current.state.is_completed(), current.state
    own = (current.end_time - current.start_time).total_seconds() if current.end_time else 0.0
    return wall, own, str(current.infrastructure_pid or "")


def standby_ids(server: Any, pool: str) -> set[str]:
    from pandastack_jobs.warm_start import STANDBY_LABEL
    from prefect_blocks.worker import META_POOL

    return {
        sb.id
        for sb in server.client().sandboxes.list()
        if (sb.metadata or {}).get(META_POOL) == pool and STANDBY_LABEL in (sb.metadata or {})
    }


def standby_memory(server: Any, sandbox_id: str) -> dict[str, float]:
    """The waiting runner's RSS and PSS (MiB): what one standby costs while it waits."""
    from pandastack_jobs.warm_start import PID_PATH

    sb = server.client().sandboxes.get(sandbox_id)
    out = sb.exec(f'cat /proc/"$(cat {PID_PATH})"/smaps_rollup', timeout_seconds=30).stdout
    fields = {line.split(":")[0]: line.split()[1] for line in out.splitlines() if line.strip().endswith("kB")}
    return {"rss_mib": round(int(fields["Rss"]) / 1024, 1), "pss_mib": round(int(fields["Pss"]) / 1024, 1)}


async def measure_async(rounds: int, server: Any) -> dict[str, Any]:
    """All three workers live for the whole run (a warm pool is a long-lived worker's); the
    kinds rotate every round so drift hits each alike. Before a warm sample the pool is
    waited on until a standby is ready (not timed: runs arriving no faster than the refill)."""
    import contextlib

    import anyio
    from prefect.client.orchestration import get_client
    from prefect.workers.process import ProcessWorker

    from prefect_blocks.worker import PandaStackWorker

    kinds = {
        "process": (ProcessWorker, "bench-process"),
        "pandastack": (PandaStackWorker, "bench-pandastack"),
        "pandastack_warm": (PandaStackWorker, "bench-pandastack-warm"),
    }
    walls: dict[str, list[float]] = {k: [] for k in kinds}
    owns: dict[str, list[float]] = {k: [] for k in kinds}
    refills: list[float] = []
    hits = 0
    async with contextlib.AsyncExitStack() as stack:
        client = await stack.enter_async_context(get_client())
        workers = {
            name: await stack.enter_async_context(cls(work_pool_name=pool, prefetch_seconds=10))
            for name, (cls, pool) in kinds.items()
        }
        standby_pool = await workers["pandastack_warm"].prewarm()
        assert standby_pool is not None

        async def ready() -> float:
            started = time.perf_counter()
            with anyio.fail_after(300):
                while standby_pool.ready < 1:
                    await anyio.sleep(0.05)
            return time.perf_counter() - started

        first_fill = await ready()
        log(f"prefect worker: first standby ready after {first_fill:.1f} s")
        ids = await anyio.to_thread.run_sync(standby_ids, server, "bench-pandastack-warm")
        memory = await anyio.to_thread.run_sync(standby_memory, server, next(iter(ids)))
        log(f"prefect worker: one waiting standby's runner: {memory}")

        async def sample(name: str) -> tuple[float, float]:
            nonlocal hits
            if name == "pandastack_warm":
                refills.append(await ready())
                before = await anyio.to_thread.run_sync(standby_ids, server, "bench-pandastack-warm")
            wall, own, pid = await one_run(workers[name], client, f"bench-trivial/{kinds[name][1]}")
            if name == "pandastack_warm":
                hits += pid in before
            return wall, own

        names = list(kinds)
        for name in names:  # warm-up: imports, first deploy pull
            await sample(name)
            log(f"prefect worker: warm-up {name} done")
        hits, refills[:] = 0, []
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                wall, own = await sample(name)
                walls[name].append(wall)
                owns[name].append(own)
            log(f"prefect worker: round {r + 1}/{rounds}")
    return {
        "walls": walls,
        "owns": owns,
        "waits": refills,
        "hits": hits,
        "standby_memory": memory,
        "first_fill_s": round(first_fill, 2),
    }


def measure(rounds: int) -> dict[str, Any]:
    import anyio
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL

    from pandastack_local import LocalServer
    from prefect_blocks import PandaStackCredentials
    from prefect_blocks.worker import PandaStackWorker

    code = Path(tempfile.mkdtemp(prefix="bench-worker-flow-"))
    code.chmod(0o755)  # read by the sandbox's unprivileged uid
    (code / "bench_flow.py").write_text(FLOW)
    templates = Path(tempfile.mkdtemp(prefix="bench-worker-template-"))
    (templates / "template.json").write_text(
        json.dumps({"name": "prefect", "python_env": sys.prefix, "code_dirs": [str(code)]})
    )
    api = urlparse(PREFECT_API_URL.value())
    with LocalServer(template_dirs=[str(templates)], allow_egress=[f"{api.hostname}:{api.port}"]) as server:
        block = PandaStackCredentials(api_url=server.url, api_key=server.api_key).save(
            "bench-worker", overwrite=True
        )
        template = PandaStackWorker.get_default_base_job_template()
        template["variables"]["properties"]["credentials"]["default"] = {
            "$ref": {"block_document_id": str(block)}
        }
        warm_template = json.loads(json.dumps(template))
        warm_template["variables"]["properties"]["warm_pool_size"]["default"] = 1

        async def pools() -> None:
            async with get_client() as client:
                await client.create_work_pool(WorkPoolCreate(name="bench-process", type="process"))
                await client.create_work_pool(
                    WorkPoolCreate(name="bench-pandastack", type="pandastack", base_job_template=template)
                )
                await client.create_work_pool(
                    WorkPoolCreate(
                        name="bench-pandastack-warm", type="pandastack", base_job_template=warm_template
                    )
                )

        anyio.run(pools)
        source = flow.from_source(source=str(code), entrypoint="bench_flow.py:trivial")
        for pool in ("bench-process", "bench-pandastack", "bench-pandastack-warm"):
            source.deploy(name=pool, work_pool_name=pool, build=False, push=False, print_next_steps=False)
        got = anyio.run(measure_async, rounds, server)
        assert server.client().sandboxes.list() == [], "the pandastack worker leaked a sandbox"
    walls, owns = got["walls"], got["owns"]
    out: dict[str, Any] = {name: summary(values) for name, values in walls.items()}
    out["prefect_run_time"] = {name: summary(values) for name, values in owns.items()}
    for kind in ("pandastack", "pandastack_warm"):
        out[f"ratio_{kind}_to_process"] = {
            "p50": ratio(out[kind]["p50_ms"], out["process"]["p50_ms"]),
            "mean": ratio(out[kind]["mean_ms"], out["process"]["mean_ms"]),
        }
    out["ratio_warm_to_cold_pandastack_p50"] = ratio(
        out["pandastack_warm"]["p50_ms"], out["pandastack"]["p50_ms"]
    )
    out["extra_ms_per_flow_run_p50"] = round(out["pandastack"]["p50_ms"] - out["process"]["p50_ms"], 1)
    out["warm_extra_ms_per_flow_run_p50"] = round(
        out["pandastack_warm"]["p50_ms"] - out["process"]["p50_ms"], 1
    )
    out["warm_hits"] = got["hits"]
    out["standby_wait"] = summary(got["waits"]) if got["waits"] else {}
    out["standby_first_fill_s"] = got["first_fill_s"]
    out["standby_memory"] = got["standby_memory"]
    out["samples_ms"] = {k: [round(v * 1000, 1) for v in vs] for k, vs in walls.items()}
    return out


def main() -> None:
    args = int_options(out=True, rounds=6)
    with prefect_server(180):
        log(f"prefect worker: {args.rounds} rounds x (process, pandastack) flow runs (server up)")
        data = {"machine": machine(), "rounds": args.rounds, **measure(args.rounds)}
    data["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    log(
        f"prefect worker: load {data['machine']['load_avg']} -> {data['load_avg_end']}; p50 over process: "
        f"cold {data['ratio_pandastack_to_process']['p50']}, "
        f"warm {data['ratio_pandastack_warm_to_process']['p50']} "
        f"(target <= 1.2); warm hits {data['warm_hits']}/{args.rounds}; standby {data['standby_memory']}"
    )


if __name__ == "__main__":
    main()
