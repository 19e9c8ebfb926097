"""(issue 18 item 7) Flow-run overhead of the ``pandastack`` worker against the ``process`` worker.

Run in ``.venv-prefect``: ``python -m benchmarks.prefect_worker --out FILE``. One temporary
Prefect API (``prefect_test_harness``), one pandastack-local with a ``prefect`` template
(this venv + the flow's directory, egress to the API only), a ``process`` pool and a
``pandastack`` pool with the same trivial flow deployed to each. Each sample is one flow
run from the worker's poll to the run's final state (Completed), measured by the client;
the two kinds alternate, so the ratio is taken under the same machine drift. Prefect's own
``start_time``/``end_time`` of each run is recorded too: what is left is the infrastructure
(process start vs sandbox create + delete) and the engine's start-up inside it.
"""

from __future__ import annotations

import json
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


async def one_run(worker_cls: Any, pool: str, deployment: str) -> tuple[float, float]:
    """(wall seconds from poll to Completed, Prefect's own run time) for one flow run."""
    import anyio
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    fr = await run_deployment(deployment, timeout=0)
    async with get_client() as client, worker_cls(work_pool_name=pool, prefetch_seconds=10) as worker:
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
    return wall, own


def measure(rounds: int) -> dict[str, Any]:
    import anyio
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL
    from prefect.workers.process import ProcessWorker

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

        async def pools() -> None:
            async with get_client() as client:
                await client.create_work_pool(WorkPoolCreate(name="bench-process", type="process"))
                await client.create_work_pool(
                    WorkPoolCreate(name="bench-pandastack", type="pandastack", base_job_template=template)
                )

        anyio.run(pools)
        source = flow.from_source(source=str(code), entrypoint="bench_flow.py:trivial")
        for pool in ("bench-process", "bench-pandastack"):
            source.deploy(name=pool, work_pool_name=pool, build=False, push=False, print_next_steps=False)
        kinds = {
            "process": (ProcessWorker, "bench-process", "bench-trivial/bench-process"),
            "pandastack": (PandaStackWorker, "bench-pandastack", "bench-trivial/bench-pandastack"),
        }
        for name, args in kinds.items():  # warm-up: imports, first deploy pull, the pool's first fill
            anyio.run(one_run, *args)
            log(f"prefect worker: warm-up {name} done")
        walls: dict[str, list[float]] = {k: [] for k in kinds}
        owns: dict[str, list[float]] = {k: [] for k in kinds}
        names = list(kinds)
        for r in range(rounds):
            for name in names[r % 2 :] + names[: r % 2]:
                wall, own = anyio.run(one_run, *kinds[name])
                walls[name].append(wall)
                owns[name].append(own)
            log(f"prefect worker: round {r + 1}/{rounds}")
        assert server.client().sandboxes.list() == [], "the pandastack worker leaked a sandbox"
    out: dict[str, Any] = {name: summary(values) for name, values in walls.items()}
    out["prefect_run_time"] = {name: summary(values) for name, values in owns.items()}
    out["ratio_pandastack_to_process"] = {
        "p50": ratio(out["pandastack"]["p50_ms"], out["process"]["p50_ms"]),
        "mean": ratio(out["pandastack"]["mean_ms"], out["process"]["mean_ms"]),
    }
    out["extra_ms_per_flow_run_p50"] = round(out["pandastack"]["p50_ms"] - out["process"]["p50_ms"], 1)
    out["samples_ms"] = {k: [round(v * 1000, 1) for v in vs] for k, vs in walls.items()}
    return out


def main() -> None:
    args = int_options(out=True, rounds=6)
    with prefect_server(180):
        log(f"prefect worker: {args.rounds} rounds x (process, pandastack) flow runs (server up)")
        data = {"machine": machine(), "rounds": args.rounds, **measure(args.rounds)}
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    log(f"prefect worker: pandastack/process p50 {data['ratio_pandastack_to_process']['p50']}")


if __name__ == "__main__":
    main()
