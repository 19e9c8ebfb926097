"""Print, as JSON, the names of the Celery workers that answer a ping (run in the Airflow venv)."""

from __future__ import annotations

import json

from airflow.providers.celery.executors.celery_executor_utils import app

replies = app.control.ping(timeout=3.0) or []
print(json.dumps(sorted(name for reply in replies for name in reply)))
