"""(issue 27) Density: how many idle ``base`` sandboxes one server admits, and what they cost.

Run: ``python -m benchmarks.density [--target 500]``. Two servers in one run, both with the
default budget (host memory minus headroom): the default ``usage`` admission, creating up to
``--target`` idle sandboxes, and ``--admission limits`` (the old default), creating until the
first 507. For each: how many were admitted, the host's MemAvailable drop per sandbox, and the
create p50. Sandboxes are created 8 at a time and deleted at the end.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import log, machine, summary, write_json
from benchmarks.options import int_options


def mem_available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable")


def fill(admission: str, target: int) -> dict[str, Any]:
    from pandastack_local import LocalServer

    with LocalServer(pool_size=0, admission=admission, max_sandboxes=target + 10) as server:
        headers = {"Authorization": f"Bearer {server.api_key}"}
        ids: list[str] = []
        times: list[float] = []
        refused: str | None = None
        before = mem_available_mb()
        with httpx.Client(base_url=server.url, headers=headers, timeout=120) as http:

            def create(_: int) -> tuple[int, str, float]:
                started = time.perf_counter()
                r = http.post("/v1/sandboxes", json={"template": "base"})
                return r.status_code, r.text, time.perf_counter() - started

            with ThreadPoolExecutor(8) as pool:
                while len(ids) < target and refused is None:
                    batch = min(8, target - len(ids))
                    for status, text, took in pool.map(create, range(batch)):
                        if status == 201:
                            ids.append(httpx.Response(201, text=text).json()["id"])
                            times.append(took)
                        elif refused is None:
                            refused = f"{status}: {text[:200]}"
                time.sleep(2)  # let the agents settle before measuring
                after = mem_available_mb()
                list(pool.map(lambda i: http.delete(f"/v1/sandboxes/{i}"), ids))
        cost = (before - after) / max(len(ids), 1)
        log(f"density[{admission}]: {len(ids)} admitted, {cost:.1f} MB each, refused: {refused}")
        return {
            "admitted": len(ids),
            "mem_available_drop_mb": round(before - after, 1),
            "mb_per_sandbox": round(cost, 2),
            "create_s": summary(times),
            "first_refusal": refused,
        }


def main() -> None:
    args = int_options(target=500)
    data = {
        "machine": machine(),
        "target": args.target,
        "usage": fill("usage", args.target),
        "limits": fill("limits", args.target),
    }
    write_json("density", data)


if __name__ == "__main__":
    main()
