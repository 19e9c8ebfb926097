"""Run in the Prefect venv against the e2e server: a ``pandastack`` work pool whose default
credentials are a saved block, and the pool flow deployed to it from local source."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectAlreadyExists

from prefect_blocks import PandaStackCredentials
from prefect_blocks.worker import PandaStackWorker

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "e2e" / "pool_flows"


async def make_pool(name: str, block_id: str) -> None:
    template = PandaStackWorker.get_default_base_job_template()
    props = template["variables"]["properties"]
    props["credentials"]["default"] = {"$ref": {"block_document_id": block_id}}
    props["timeout"]["default"] = 300
    async with get_client() as client:
        try:
            await client.create_work_pool(
                WorkPoolCreate(name=name, type="pandastack", base_job_template=template)
            )
        except ObjectAlreadyExists:
            pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pool", required=True)
    ap.add_argument("--block", required=True)
    ap.add_argument("--api-url", required=True)
    ap.add_argument("--api-key", required=True)
    args = ap.parse_args()
    block_id = PandaStackCredentials(api_url=args.api_url, api_key=args.api_key).save(
        args.block, overwrite=True
    )
    asyncio.run(make_pool(args.pool, str(block_id)))
    f = flow.from_source(source=str(SOURCE), entrypoint="pool_flows.py:pool_inside")
    f.deploy(name="pool", work_pool_name=args.pool, build=False, push=False, print_next_steps=False)
    print("deployed pool_flows.py:pool_inside as pool-inside/pool")


if __name__ == "__main__":
    main()
