"""Where the core's time over the raw SDK loop goes: one difference at a time, interleaved.

Run: ``python -m benchmarks.breakdown [--rounds R --batch B]``. The core keeps three rails
a hand-written SDK loop (benchmarks/overhead.py's (a)) does not have, each for a reason:

- ``stream``: ``exec_stream`` (SSE) instead of ``exec``, so output reaches the
  engine's log while the job runs;
- ``guard``: the guest-side hard timeout (``cd /work && VAR=... exec timeout -k 5 T sh -c
  CMD``), because the server's timeout is not trusted;
- a size-checked result: at most ``limit + 1`` bytes are taken from the sandbox.

Variant ``raw+X`` is the raw loop (:func:`benchmarks.overhead.raw_sdk_job`) plus only X;
``core, 7 calls`` is ``run_job``'s steps one round trip each (PUT files and input, exec,
stat, read: what it did before the fold); ``core`` is ``run_job`` as it is: one exec
writes the files, runs the job and carries the result back (create, exec, delete).
cProfile cannot attribute this (the time is spent waiting on sockets for the server and
the guest), so it is attributed by difference, under the same drift.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import pandastack

from benchmarks import common  # the one job every benchmark runs (common.JOB_CODE, ...)
from benchmarks.common import interleaved, log, machine, summary, write_json
from benchmarks.options import int_options
from benchmarks.overhead import TTL, core_job, raw_sdk_job


def variant(client: pandastack.Client, *, stream: bool, guard: bool, stat: bool) -> Callable[[], Any]:
    """The raw loop with a chosen subset of the core's three additions."""
    from pandastack_jobs import guest

    command = "cd /work && python3 run.py"
    if guard:
        env = guest.job_env("/work/result.json", {})
        command = guest.foreground_command("python3 run.py", common.JOB_TIMEOUT, env)

    def run() -> Any:
        sb = client.sandboxes.create(
            template=common.TEMPLATE, ttl_seconds=TTL, metadata={"job_id": uuid.uuid4().hex}
        )
        try:
            sb.filesystem.write("/work/input.json", json.dumps(common.JOB_INPUT).encode())
            sb.filesystem.write("/work/run.py", common.JOB_CODE.encode())
            if stream:
                chunks: list[str] = []
                code = sb.exec_stream(
                    command,
                    on_stdout=chunks.append,
                    on_stderr=chunks.append,
                    timeout_seconds=common.JOB_TIMEOUT,
                )
            else:
                code = sb.exec(command, timeout_seconds=common.JOB_TIMEOUT).exit_code
            if code != 0:
                raise RuntimeError(f"exit {code}")
            if stat:
                sb.filesystem.stat("/work/result.json")
            result = json.loads(sb.filesystem.read("/work/result.json"))
        finally:
            client.sandboxes.delete(sb.id)
        assert result == common.EXPECTED, result
        return result

    return run


def unfolded_core_job(client: pandastack.Client) -> Any:
    """``run_job``'s rails with one round trip per step (a replaced exec step is never folded)."""
    from pandastack_jobs import JobRun, JobSpec

    run = JobRun(client, JobSpec(**common.JOB_OPTIONS))
    outcome = run.run(execute=run.execute)
    assert outcome.ok and outcome.result == common.EXPECTED, outcome.reason
    return outcome.result


def guest_wrapper_cost(client: pandastack.Client, rounds: int) -> dict[str, Any]:
    """Exec ``true`` bare, under the guard, and as the folded job (input written by ``printf``,
    the result read back by ``dd``), alternating, in one sandbox: the guest-side process starts
    (``timeout``, ``sh -c``, ``dd``) apart from create/delete noise.
    """
    from pandastack_jobs import guest

    env = guest.job_env("/work/result.json", {})
    wrapped = guest.foreground_command("true", common.JOB_TIMEOUT, env)
    trailer = guest.ResultTrailer("/work/result.json", 1024 * 1024)
    folded = guest.job_script(
        "true", common.JOB_TIMEOUT, env, {"/work/input.json": json.dumps(common.JOB_INPUT)}, trailer
    )
    sb = client.sandboxes.create(template=common.TEMPLATE, ttl_seconds=TTL)
    try:
        sb.filesystem.write("/work/result.json", json.dumps(common.EXPECTED).encode())
        samples = interleaved(
            {
                "exec_true": lambda: sb.exec("cd /work && true", timeout_seconds=common.JOB_TIMEOUT),
                "exec_true_wrapped": lambda: sb.exec(wrapped, timeout_seconds=common.JOB_TIMEOUT),
                "exec_true_folded": lambda: sb.exec(folded, timeout_seconds=common.JOB_TIMEOUT),
            },
            rounds,
            1,
        )
    finally:
        client.sandboxes.delete(sb.id)
    return {name: summary(values) for name, values in samples.items()}


def main() -> None:
    args = int_options(rounds=5, batch=8)
    from pandastack_local import LocalServer

    with LocalServer() as server:
        client = server.client()
        variants = {
            "raw": lambda: raw_sdk_job(client),
            "raw+stream": variant(client, stream=True, guard=False, stat=False),
            "raw+guard": variant(client, stream=False, guard=True, stat=False),
            "raw+stat": variant(client, stream=False, guard=False, stat=True),
            "raw+all3": variant(client, stream=True, guard=True, stat=True),
            "core, 7 calls": lambda: unfolded_core_job(client),
            "core": lambda: core_job(client),
        }
        log(f"breakdown: {args.rounds} rounds x {args.batch} jobs x {len(variants)} variants")
        samples = interleaved(variants, args.rounds, args.batch)
        wrapper = guest_wrapper_cost(client, args.rounds * args.batch * 3)
    out = {name: summary(values) for name, values in samples.items()}
    base = out["raw"]["p50_ms"]
    for stats in out.values():
        stats["extra_p50_ms"] = round(stats["p50_ms"] - base, 2)
        stats["ratio_p50"] = round(stats["p50_ms"] / base, 3)
    data = {
        "machine": machine(),
        "n_per_variant": args.rounds * args.batch,
        "variants": out,
        "guest_wrapper": wrapper,
    }
    log(f"breakdown written to {write_json('breakdown', data)}")


if __name__ == "__main__":
    main()
