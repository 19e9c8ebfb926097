"""A template that cannot render is the DAG's mistake, not the sandbox's: fail once, never retry.

Airflow treats any exception while rendering a task's fields like a job failure, so an
``UndefinedError`` (``{{ ds }}`` in a manual or REST-triggered run of Airflow 3, which has no
logical date) spent every retry on a try that can never render. These errors become
``AirflowFailException`` (dead-letter) with the fix in the message.
"""

from __future__ import annotations

import jinja2

# The context keys Airflow 3 leaves out when a run has no logical date (manual, REST, asset).
LOGICAL_DATE_KEYS = (
    "ds", "ds_nodash", "ts", "ts_nodash", "ts_nodash_with_tz", "logical_date", "data_interval_start",
    "data_interval_end", "task_instance_key_str", "prev_data_interval_start_success",
    "prev_data_interval_end_success",
)  # fmt: skip
RUN_DATE_HINT = "{{ (dag_run.logical_date or dag_run.run_after) | ds }}"


def template_error_message(task_id: str, exc: jinja2.TemplateError) -> str:
    """What failed to render and, for a logical-date key, the template that works in every run."""
    text = f"task {task_id!r}: a templated field cannot render ({type(exc).__name__}: {exc}); not retried"
    if isinstance(exc, jinja2.UndefinedError) and any(f"'{k}'" in str(exc) for k in LOGICAL_DATE_KEYS):
        text += (
            ". Manual and REST-triggered runs of Airflow 3 have no logical date, so ds, ts, "
            f"logical_date and data_interval_* are undefined there: use {RUN_DATE_HINT} (the run's date "
            "in every kind of run)"
        )
    return text
