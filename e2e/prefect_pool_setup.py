"""Run in the Prefect venv against the e2e server: a ``pandastack`` work pool whose default
credentials are a saved block, and the pool flow deployed to it from local source."""

from __future__ import annotations

import asyncio
from pathlib import Path

from e2e.prefect_setup import deploy, make_pool, save_credentials, setup_args
from prefect_blocks.worker import PandaStackWorker

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "e2e" / "pool_flows"


def main() -> None:
    args = setup_args()
    block_id = save_credentials(args)
    template = PandaStackWorker.get_default_base_job_template()
    props = template["variables"]["properties"]
    props["credentials"]["default"] = {"$ref": {"block_document_id": block_id}}
    props["timeout"]["default"] = 300
    asyncio.run(make_pool(args.pool, "pandastack", template))
    deploy(SOURCE, "pool_flows.py:pool_inside", "pool", args.pool)
    print("deployed pool_flows.py:pool_inside as pool-inside/pool")


if __name__ == "__main__":
    main()
