"""(3) Warm state: a job that needs a 2 s warm-up, create-per-job vs warm parent + fork per job.

Run: ``python -m benchmarks.warm [--rounds R]``. The warm-up stands for "load a
model / warm a dataset": it sleeps 2 s and writes its state to disk. On
pandastack-local a fork copies the parent's *disk* (its memory is not copied,
as with the real platform's cold fork), so the warm state must live on disk;
the hosted platform's same-host fork also copies memory copy-on-write. Create-per-job runs
warm-up + job in a fresh sandbox each time; the pool pays the warm-up once
(reported separately) and runs each job in a fork with ``WarmPool.run``.

Then the memory-fork spike's figures (``benchmarks.fork_spike``, issue 27): a fork of a parent
whose live process holds 100 MB (and whether the child got that process), the server-side
zygote's floor, and whether the host's criu can start.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from benchmarks.common import (
    JOB_INPUT,
    interleaved,
    log,
    machine,
    ratio,
    summary,
    timed,
    write_json,
)
from benchmarks.options import int_options

WARMUP_SECONDS = 2.0
WARM_CODE = f"""\
import json, time
time.sleep({WARMUP_SECONDS})
json.dump({{"weights": list(range(10000))}}, open("/work/model.json", "w"))
"""
JOB_CODE = """\
import json, os
model = json.load(open("/work/model.json"))
rows = json.load(open(os.environ["JOB_INPUT"]))["rows"]
json.dump({"score": sum(r * model["weights"][r] for r in rows)}, open(os.environ["JOB_RESULT"], "w"))
"""
EXPECTED = {"score": sum(r * r for r in JOB_INPUT["rows"])}


def main() -> None:
    args = int_options(rounds=6)
    from benchmarks import fork_spike
    from pandastack_jobs import JobSpec, WarmPool, run_job
    from pandastack_local import LocalServer

    files = {"warm.py": WARM_CODE, "job.py": JOB_CODE}
    cold = JobSpec(command="python3 warm.py && python3 job.py", files=files, input=JOB_INPUT, timeout=60)
    job = JobSpec(command="python3 job.py", files={"job.py": JOB_CODE}, input=JOB_INPUT, timeout=60)
    warmup = JobSpec(command="python3 warm.py", files={"warm.py": WARM_CODE}, result_path=None, timeout=60)

    def check(outcome: Any) -> None:
        assert outcome.ok and outcome.result == EXPECTED, outcome.reason

    zygote = fork_spike.zygote_floor(max(args.rounds, 3) * 3)  # before any thread starts
    with LocalServer() as server:
        client = server.client()
        pool = WarmPool(client, warmup=warmup)
        parent_s = timed(pool.start_parent)
        try:
            variants = {
                "create_per_job": lambda: check(run_job(client, cold)),
                "fork_per_job": lambda: check(pool.run(job)),
            }
            log(f"warm: {args.rounds} rounds x 1 job x 2 variants (+ one 2 s parent warm-up)")
            samples = interleaved(variants, args.rounds, 1, warmup=1)
        finally:
            pool.close()
        memory_fork = fork_spike.memory_fork(
            client, lambda path: _get(server, path), max(args.rounds // 2, 2)
        )
        assert client.sandboxes.list() == [], "a variant leaked a sandbox"
    create, fork = summary(samples["create_per_job"]), summary(samples["fork_per_job"])
    n = len(samples["fork_per_job"])
    amortised_ms = (parent_s * 1000 + fork["mean_ms"] * n) / n
    data = {
        "machine": machine(),
        "warmup_s": WARMUP_SECONDS,
        "parent_start_ms": round(parent_s * 1000, 2),
        "create_per_job": create,
        "fork_per_job": fork,
        "ratio_p50": ratio(fork["p50_ms"], create["p50_ms"]),
        "ratio_p99": ratio(fork["p99_ms"], create["p99_ms"]),
        "fork_amortised_mean_ms": round(amortised_ms, 2),
        "ratio_amortised_mean": ratio(amortised_ms, create["mean_ms"]),
        "target_ratio": 0.25,
        "memory_fork": {"isolation": server.isolation, **memory_fork},
        "zygote_floor": zygote,
        "criu": fork_spike.criu(),
    }
    log(f"warm: memory fork {json.dumps(data['memory_fork'])}; zygote {json.dumps(zygote)}")
    log(f"warm: criu {json.dumps(data['criu'])}")
    log(f"warm written to {write_json('warm', data)}")


def _get(server: Any, path: str) -> Any:
    request = urllib.request.Request(server.url + path, headers={"Authorization": f"Bearer {server.api_key}"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.loads(resp.read())


if __name__ == "__main__":
    main()
