"""Tenant-supplied transforms: one sandbox per tenant, mapped.

Every file in ``sample_jobs/tenants/`` is one tenant's code, run against that tenant's
rows in its own sandbox. Hostile tenants (a memory hog, a fork bomb, an escape
attempt) fail with a clear reason or prove the wall held; every other tenant
succeeds. The flow fails only if an honest tenant failed.
"""

from __future__ import annotations

from typing import Any

from _jobs import HOSTILE_EXIT_CODE, tenant_files, tenant_rows
from prefect import flow, unmapped
from prefect.states import State

from prefect_blocks import run_in_sandbox


@flow(name="pandastack-tenant-transforms", log_prints=True)
def tenant_transforms(tenants: list[str] | None = None) -> dict[str, Any]:
    """Run each tenant's transform in its own sandbox; returns ``{tenant: result or failure reason}``."""
    files = tenant_files()
    names = tenants or list(files)
    states: list[State] = run_in_sandbox.map(
        unmapped("python3 transform.py"),
        files=[{"transform.py": files[n].read_text()} for n in names],
        input=[{"rows": tenant_rows(n)} for n in names],
        timeout=10,
        metadata=[{"tenant": n} for n in names],
        permanent_exit_codes=unmapped([HOSTILE_EXIT_CODE]),
        job_name=names,
        return_state=True,
    )
    report: dict[str, Any] = {}
    honest_failures = []
    for name, state in zip(names, states, strict=True):
        if state.is_completed():
            report[name] = {"ok": True, "result": state.result()}
        else:
            report[name] = {"ok": False, "reason": state.message}
            if not name.startswith("evil_"):
                honest_failures.append(name)
        print(f"{name}: {'ok' if report[name]['ok'] else 'FAILED: ' + str(report[name]['reason'])}")
    if honest_failures:
        raise RuntimeError(f"honest tenants failed: {honest_failures}")
    return report


if __name__ == "__main__":
    tenant_transforms()
