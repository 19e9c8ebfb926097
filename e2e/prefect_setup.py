"""Run in the Prefect venv against the e2e server: save the credentials block, create the
``process`` work pool, and create the deployments (e2e-only and the examples in ``flows/``)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectAlreadyExists

from prefect_blocks import PandaStackCredentials

REPO = Path(__file__).resolve().parent.parent

# (source dir, entrypoint, deployment name); example flows are added when they exist.
E2E_DEPLOYMENTS = [(REPO / "e2e" / "flows", "e2e_flows.py:sandbox_job", "e2e")]


async def make_pool(name: str, pool_type: str = "process", base_job_template: dict | None = None) -> None:
    """Create the work pool unless it exists (a re-run of the e2e reuses its server)."""
    pool = WorkPoolCreate(name=name, type=pool_type, base_job_template=base_job_template or {})
    async with get_client() as client:
        try:
            await client.create_work_pool(pool)
        except ObjectAlreadyExists:
            pass


def setup_args() -> argparse.Namespace:
    """The setup scripts' arguments: the pool, the credentials block's name and what it holds."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--pool", required=True)
    ap.add_argument("--block", required=True)
    ap.add_argument("--api-url", required=True)
    ap.add_argument("--api-key", required=True)
    return ap.parse_args()


def save_credentials(args: argparse.Namespace) -> str:
    """Save the credentials block; its document id."""
    return str(
        PandaStackCredentials(api_url=args.api_url, api_key=args.api_key).save(args.block, overwrite=True)
    )


def deploy(source: Path, entrypoint: str, name: str, pool: str) -> None:
    from prefect import flow

    f = flow.from_source(source=str(source), entrypoint=entrypoint)
    f.deploy(name=name, work_pool_name=pool, build=False, push=False, print_next_steps=False)


def main() -> None:
    args = setup_args()
    save_credentials(args)
    asyncio.run(make_pool(args.pool))
    for source, entrypoint, name in E2E_DEPLOYMENTS + example_deployments():
        deploy(source, entrypoint, name, args.pool)
        print(f"deployed {entrypoint} as {name}")


def example_deployments() -> list[tuple[Path, str, str]]:
    """The repository's example flows (flows/), deployed to the same pool."""
    flows = REPO / "flows"
    return [
        (flows, "tenant_transforms.py:tenant_transforms", "tenant-transforms"),
        (flows, "scheduled_report.py:scheduled_report", "daily-orders-report"),
        # flows/queue_worker.py's consume_queue flow, the broker and batch given with each run.
        (flows, "queue_worker.py:consume_queue", "queue-worker"),
    ]


if __name__ == "__main__":
    main()
