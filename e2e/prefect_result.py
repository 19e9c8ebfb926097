"""Print a flow run's return value as JSON (run in the Prefect venv): ``python -m e2e.prefect_result ID``."""

from __future__ import annotations

import json
import sys

from prefect.client.orchestration import get_client

with get_client(sync_client=True) as client:
    state = client.read_flow_run(sys.argv[1]).state
    assert state is not None
    print(json.dumps(state.result(), default=str))
