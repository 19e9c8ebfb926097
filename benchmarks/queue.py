"""(issue 28) The queue consumer on a real Redis: throughput against a shared worker, its overhead
over ``run_job`` in a loop, and what chunks of K messages per sandbox gain.

Run in ``.venv-airflow``: ``python -m benchmarks.queue [--n N --rounds R]``. It starts its
own ``redis-server`` (:mod:`benchmarks.redis_server`) and ``pandastack_local``, and
stops both. Every variant consumes the *same* N messages (the JSON job of
:mod:`benchmarks.common`, in the ``pandastack-job/1`` format, four tenants) from a
fresh stream of the same Redis and replies each result to the stream's reply stream:

- ``consumer cN``: :class:`pandastack_jobs.queue.Consumer`, concurrency N, one sandbox per message;
- ``shared cN``: the same Consumer with the sandbox swapped for a host subprocess per message
  (the job's files in a fresh temporary directory): a shared worker's isolation, the same
  receive, reply and ack path, so the gap is what a sandbox per message costs;
- ``chunk8 cN``: the Consumer with ``chunk_size=8`` (up to 8 messages of one tenant per sandbox);
- ``loop``: the same jobs through ``run_job`` one after another, no broker at all.

Variants run in a fresh (seeded) order every round, each after a 0.5 s pause that lets the
server refill its warm pool, so drift on the shared machine and the previous variant's burst
hit each alike.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import (
    EXPECTED,
    JOB_CODE,
    JOB_INPUT,
    JOB_TIMEOUT,
    TEMPLATE,
    bench_consumer,
    log,
    machine,
    ratio,
    write_json,
)
from benchmarks.options import int_options
from benchmarks.redis_server import RedisServer

LEVELS = (1, 2, 4, 8)
TENANTS = 4
CHUNK = 8
SETTLE_S = 0.5
# The host's own python3, as a shared worker would run it (not this venv's: its site-packages
# would make every start-up slower than the sandbox's template python).
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


def messages(n: int) -> list[bytes]:
    return [
        json.dumps(
            {
                "id": f"m{i}",
                "tenant": f"t{i % TENANTS}",
                "command": "python3 run.py",
                "files": {"run.py": JOB_CODE},
                "input": JOB_INPUT,
            }
        ).encode()
        for i in range(n)
    ]


def subprocess_runner(job: Any, spec: Any, run: Callable[[], Any]) -> Any:
    """A shared worker's run of one message: its files in a fresh directory, a host subprocess."""
    from pandastack_jobs import JobOutcome

    work = Path(tempfile.mkdtemp(prefix="bench-shared-"))
    try:
        for path, content in spec.files.items():
            target = work / os.path.relpath(path, "/work")
            target.write_bytes(content.encode() if isinstance(content, str) else content)
        (work / "input.json").write_text(json.dumps(spec.input))
        env = {
            "PATH": SYSTEM_PATH,
            "JOB_WORKDIR": str(work),
            "JOB_INPUT": str(work / "input.json"),
            "JOB_RESULT": str(work / "result.json"),
        }
        cp = subprocess.run(
            ["sh", "-c", spec.command], cwd=work, env=env, capture_output=True, timeout=spec.timeout
        )
        if cp.returncode != 0:
            return JobOutcome(ok=False, reason=cp.stderr.decode(errors="replace")[-500:])
        result = json.loads((work / "result.json").read_text())
        return JobOutcome(ok=True, result=result, has_result=True, reason="succeeded")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def consume(redis: RedisServer, conn: Any, bodies: list[bytes], **kw: Any) -> dict[str, float]:
    """Send ``bodies`` to a fresh stream, then time one Consumer until every message is acked."""
    import redis as redis_client

    from pandastack_jobs.queue import open_transport, reply_sink

    stream = f"bench-{uuid.uuid4().hex[:8]}"
    producer = open_transport(redis.url(stream))
    producer.connect()
    for body in bodies:
        producer.send(body)
    producer.close()
    n = len(bodies)
    transport = open_transport(redis.url(stream))
    reply = reply_sink(transport)
    last = [0.0]

    def sink(job: Any, delivery: Any, outcome: Any) -> None:
        reply(job, delivery, outcome)
        last[0] = time.perf_counter()  # the run's end: the last result out (not the drain after it)

    consumer = bench_consumer(transport, conn, sink, TEMPLATE, **kw)
    started = time.perf_counter()
    stats = consumer.run(until=lambda s: s.acked + s.dead_lettered >= n)
    wall = last[0] - started
    r = redis_client.Redis(port=redis.port)
    replies = [json.loads(f[b"body"]) for _, f in r.xrange(f"{stream}:results") or []]  # type: ignore[index]
    r.delete(stream, f"{stream}:results", f"{stream}:dead", f"{stream}:delayed")
    r.close()
    assert stats.acked == n and len(replies) == n, (stats, len(replies))
    assert all(x["result"] == EXPECTED for x in replies), replies[:2]
    return {"wall_s": wall, "peak_sandboxes": stats.peak_sandboxes, "chunks": stats.chunks}


def loop(client: Any, bodies: list[bytes]) -> dict[str, float]:
    """The same jobs (same specs, keys included) through ``run_job`` one after another."""
    from pandastack_jobs import run_job
    from pandastack_jobs.queue import parse

    specs = [
        parse(b, f"m{i}", defaults={"template": TEMPLATE, "timeout": JOB_TIMEOUT}).spec("loop", 1)
        for i, b in enumerate(bodies)
    ]
    started = time.perf_counter()
    for spec in specs:
        outcome = run_job(client, spec)
        assert outcome.ok and outcome.result == EXPECTED, outcome.reason
    return {"wall_s": time.perf_counter() - started, "peak_sandboxes": 1, "chunks": 0}


def main() -> None:
    args = int_options(n=32, rounds=4)
    from pandastack_jobs import ConnectionConfig
    from pandastack_local import LocalServer

    start = machine()
    log(f"queue: load average at start {start['load_avg']}")
    bodies = messages(args.n)
    with RedisServer() as redis, LocalServer() as server:
        conn = ConnectionConfig(api_url=server.url, api_key=server.api_key)
        client = server.client()
        variants: dict[str, Callable[[], dict[str, float]]] = {"loop": lambda: loop(client, bodies)}
        for c in LEVELS:
            each = functools.partial(consume, redis, conn, bodies, concurrency=c)
            variants[f"consumer c{c}"] = each
            variants[f"shared c{c}"] = functools.partial(each, runner=subprocess_runner)
            variants[f"chunk{CHUNK} c{c}"] = functools.partial(each, chunk_size=CHUNK)
        names = list(variants)
        # Warm-up: imports, the template's pool, the Redis connection path.
        loop(client, bodies[:4])
        consume(redis, conn, bodies[:4], concurrency=1)
        consume(redis, conn, bodies[:4], concurrency=1, runner=subprocess_runner)
        consume(redis, conn, bodies[:4], concurrency=1, chunk_size=CHUNK)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        log(f"queue: {args.rounds} rounds x {len(names)} variants x {args.n} messages")
        for r in range(args.rounds):
            # A fresh order every round (a rotation would keep each variant behind the same
            # neighbour: the loop always after the 8-sandbox burst, paying the pool's refill),
            # and a pause before each run so the server's warm pool is full again.
            order = random.Random(r).sample(names, len(names))
            for name in order:
                time.sleep(SETTLE_S)
                runs[name].append(variants[name]())
            log(f"queue: round {r + 1} done, load average {[round(x, 2) for x in os.getloadavg()]}")
        assert client.sandboxes.list() == [], "a variant leaked a sandbox"
    end = machine()
    log(f"queue: load average at end {end['load_avg']}")
    data = report(runs, args.n)
    data.update(machine=start, finished=end, n=args.n, rounds=args.rounds, tenants=TENANTS, chunk=CHUNK)
    log(f"queue written to {write_json('queue', data)}")
    for lv in data["levels"]:
        log(
            f"  c={lv['concurrency']}: consumer {lv['consumer_jobs_s']} jobs/s, "
            f"shared {lv['shared_jobs_s']}, "
            f"chunk{CHUNK} {lv['chunk_jobs_s']} (consumer/shared {lv['consumer_vs_shared']}, "
            f"chunk gain {lv['chunk_gain']}x)"
        )
    log(f"  overhead over run_job in a loop: {data['overhead']['per_message_ms']} ms/message")


def report(runs: dict[str, list[dict[str, float]]], n: int) -> dict[str, Any]:
    """Median throughput per variant, the ratios at each level, the consumer's overhead."""

    def wall(name: str) -> float:
        return statistics.median(x["wall_s"] for x in runs[name])

    def rate(name: str) -> float:
        return round(n / wall(name), 2)

    levels = []
    for c in LEVELS:
        consumer, shared, chunk = f"consumer c{c}", f"shared c{c}", f"chunk{CHUNK} c{c}"
        levels.append(
            {
                "concurrency": c,
                "consumer_jobs_s": rate(consumer),
                "shared_jobs_s": rate(shared),
                "chunk_jobs_s": rate(chunk),
                "consumer_vs_shared": ratio(rate(consumer), rate(shared)),
                "chunk_gain": ratio(rate(chunk), rate(consumer)),
                "peak_sandboxes": max(x["peak_sandboxes"] for x in runs[consumer]),
                "peak_sandboxes_chunk": max(x["peak_sandboxes"] for x in runs[chunk]),
                "chunks": max(x["chunks"] for x in runs[chunk]),
            }
        )
    per_message = (wall("consumer c1") - wall("loop")) / n * 1000
    return {
        "levels": levels,
        "overhead": {
            "loop_jobs_s": rate("loop"),
            "consumer_c1_jobs_s": rate("consumer c1"),
            "loop_ms_per_message": round(wall("loop") / n * 1000, 2),
            "consumer_ms_per_message": round(wall("consumer c1") / n * 1000, 2),
            "per_message_ms": round(per_message, 2),
            "consumer_vs_loop": ratio(wall("consumer c1"), wall("loop")),
            "loop_wall_range_s": [
                round(min(x["wall_s"] for x in runs["loop"]), 3),
                round(max(x["wall_s"] for x in runs["loop"]), 3),
            ],
            "consumer_c1_wall_range_s": [
                round(min(x["wall_s"] for x in runs["consumer c1"]), 3),
                round(max(x["wall_s"] for x in runs["consumer c1"]), 3),
            ],
        },
        "walls_s": {name: [round(x["wall_s"], 3) for x in xs] for name, xs in runs.items()},
    }


if __name__ == "__main__":
    main()
