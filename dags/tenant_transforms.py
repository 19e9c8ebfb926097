"""Tenant-supplied transforms: one sandbox per tenant, dynamically mapped.

Every file in ``sample_jobs/tenants/`` is one tenant's code, run against that tenant's
rows in its own sandbox. Some tenants are hostile on purpose (a memory hog, a
fork bomb, an escape attempt): their tasks fail with a clear reason, and every
other tenant's task succeeds. The ``pandastack_sandboxes`` pool bounds how many
sandboxes are alive at once.
"""

from __future__ import annotations

import pendulum
from _jobs import HOSTILE_EXIT_CODE, SANDBOX_POOL, example_dag, tenant_files, tenant_rows
from airflow.sdk import task

from airflow_provider.operators.sandbox import PandaStackSandboxOperator


def tenant_jobs() -> list[dict]:
    return [
        {
            "files": {"transform.py": path.read_text()},
            "input": {"rows": tenant_rows(name)},
            "metadata": {"tenant": name},
        }
        for name, path in tenant_files().items()
    ]


with example_dag("pandastack_tenant_transforms", __doc__) as dag:
    transforms = PandaStackSandboxOperator.partial(
        task_id="transform",
        command="python3 transform.py",
        timeout=10,  # the fork bomb runs into this clock; honest tenants finish in well under a second
        template="code-interpreter",
        permanent_exit_codes=[HOSTILE_EXIT_CODE],
        retries=1,
        retry_delay=pendulum.duration(seconds=1),
        pool=SANDBOX_POOL,
        map_index_template="{{ task.metadata['tenant'] }}",
    ).expand_kwargs(tenant_jobs())

    @task(trigger_rule="all_done")
    def summarize(results: list) -> dict:
        """Collect what succeeded; failed tenants show as failed tasks with their reason."""
        ok = [r for r in results if r is not None]
        return {"succeeded": len(ok)}

    summarize(transforms.output)
