"""(issue 37) The queue consumer on Apache Kafka: one sandbox per message, chunks of 8, and the same
consumer running the job in-process, at concurrency 1/2/4/8; and what bounds the sandboxed path.

Run in ``.venv-airflow``: ``python -m benchmarks.kafka [--n N --rounds R --iterations I]``. The
broker is the queue tests' own Kafka (KRaft, one node, on a free loopback port: the starter in
``e2e/brokers.py``, imported, with its cached jars), beside a ``pandastack_local``. Every
message is the same ~30 ms Python job as the Celery step's (:func:`benchmarks.common.spin_job`: its
source runs in the sandbox, its arguments and result cross as JSON), four tenants:

- ``inprocess cN``: the :class:`~pandastack_jobs.queue.Consumer` with the sandbox swapped for a
  call of the function in the consumer's own process (threads: the GIL is shared), the same
  receive, reply and commit path: what the sandbox costs on the same broker;
- ``k1 cN``: the consumer, one fresh sandbox per message;
- ``k8 cN``: the consumer with ``chunk_size=8`` (up to 8 messages of one tenant per sandbox).

Like ``benchmarks/celery.py``: one consumer per variant and level on a fresh topic, warmed with
2c messages (the group's join, the template's pool), then R rounds of N messages sent at once; a
round's time runs from its first send to its last result out, a message's latency from its send to
its result out. Recorded too, to say what bounds the sandboxed path: the core's per-phase timings
of every message (:class:`~pandastack_jobs.outcome.Timings`), the CPU seconds per message of the
server's process tree (the server and every sandbox it started, from ``/proc``), of this process
(consumer, producer, SDK) and of the broker's JVM; the job's own time in-process and a bare
``python3`` start-up.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import threading
import time
import uuid
from typing import Any

from benchmarks.common import (
    SPIN_ITERATIONS,
    SPIN_ROWS,
    WORKER_TEMPLATE,
    ServerCpu,
    bench_consumer,
    log,
    machine,
    proc_cpu_s,
    rate_and_latency,
    ratio,
    spin_job,
    tree_cpu_s,
    write_json,
)
from benchmarks.options import int_options

LEVELS = (1, 2, 4, 8)
TENANTS = 4
CHUNK = 8
VARIANTS = ("inprocess", "k1", f"k{CHUNK}")
PHASES = ("create", "deliver", "exec", "collect", "delete", "total", "run")
WAIT_S = 600.0  # a round that is not done by then is a failure, not a figure


def self_cpu_s() -> float:
    """CPU seconds of this process (all its threads: the consumer's, librdkafka's, the SDK's)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


MAIN = """

if __name__ == "__main__":
    import json, os

    args = json.load(open(os.environ["JOB_INPUT"]))
    json.dump(spin_job(args["rows"], args["iterations"]), open(os.environ["JOB_RESULT"], "w"))
"""


def spin_message_job(iterations: int) -> dict[str, Any]:
    """The message's job: :func:`spin_job`'s own source as a script with relative paths and the
    ``JOB_INPUT``/``JOB_RESULT`` the core gives every job, as a function job's script reads and
    writes them (each mate of a chunk runs in its own directory)."""
    from pandastack_jobs.pyfunc import function_source

    script = "from __future__ import annotations\n\n" + function_source(spin_job) + MAIN
    return {
        "command": "python3 job.py",
        "files": {"job.py": script},
        "input": {"rows": SPIN_ROWS, "iterations": iterations},
    }


def bodies(tag: str, n: int, job: dict[str, Any]) -> list[tuple[str, bytes]]:
    """N messages of the job in the ``pandastack-job/1`` format: (correlation id, body)."""
    out = []
    for i in range(n):
        mid = f"{tag}-{i}"
        out.append((mid, json.dumps({"id": mid, "tenant": f"t{i % TENANTS}", **job}).encode()))
    return out


def inprocess_runner(job: Any, spec: Any, run: Any) -> Any:
    """The job as a plain worker runs it: the function called in this process, no sandbox."""
    from pandastack_jobs import JobOutcome

    result = spin_job(spec.input["rows"], spec.input["iterations"])
    return JobOutcome(ok=True, result=result, has_result=True, reason="succeeded")


class Live:
    """One consumer in a thread on its own topic; ``round`` sends N messages and waits for them."""

    def __init__(self, kafka: Any, conn: Any, variant: str, c: int, iterations: int) -> None:
        from pandastack_jobs.queue import open_transport, reply_sink

        self.kafka = kafka
        self.topic = f"bench-{variant}-c{c}-{uuid.uuid4().hex[:6]}"
        self.iterations = iterations
        self.job = spin_message_job(iterations)  # read once: the source file may change meanwhile
        self.done: dict[str, float] = {}
        self.timings: dict[str, dict[str, float]] = {}
        self.outer: dict[str, float] = {}  # message id -> seconds of the whole run() of its job
        self.cond = threading.Condition()
        transport = kafka.transport(self.topic)
        reply = reply_sink(transport)

        def sink(job: Any, delivery: Any, outcome: Any) -> None:
            reply(job, delivery, outcome)
            now = time.perf_counter()
            with self.cond:
                self.done[job.message_id] = now
                if outcome.timings is not None:
                    self.timings[job.message_id] = outcome.timings.as_dict()
                    if job.message_id in self.outer:
                        self.timings[job.message_id]["run"] = self.outer[job.message_id]
                self.cond.notify_all()

        kw: dict[str, Any] = {"concurrency": c}
        if variant == "inprocess":
            kw["runner"] = inprocess_runner
        elif variant == "k1":
            kw["runner"] = self._timed
        elif variant != "k1":
            kw["chunk_size"] = CHUNK
        self.consumer = bench_consumer(transport, conn, sink, WORKER_TEMPLATE, **kw)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.producer = open_transport(kafka.url(self.topic))
        self.sent = 0

    def _timed(self, job: Any, spec: Any, run: Any) -> Any:
        """The consumer's own run (a new SDK client, the reap look-ups, ``run_job``), timed whole:
        what it takes beyond the phases ``Timings`` records."""
        t = time.perf_counter()
        outcome = run()
        self.outer[job.message_id] = time.perf_counter() - t
        return outcome

    def _run(self) -> None:
        try:
            self.consumer.run()
        except BaseException as exc:  # reported by round()
            self.error = exc

    def __enter__(self) -> Live:
        self.thread.start()
        self.producer.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.consumer.stop()
        self.thread.join(120)
        self.producer.close()

    def round(self, n: int) -> dict[str, Any]:
        """Send N messages at once; wait for every result; the round's wall and latencies."""
        batch = bodies(f"r{self.sent}", n, self.job)
        self.sent += n
        sent_at: dict[str, float] = {}
        t0 = time.perf_counter()
        for mid, body in batch:
            sent_at[mid] = time.perf_counter()
            self.producer.send(body)
        deadline = time.monotonic() + WAIT_S
        with self.cond:
            while not all(mid in self.done for mid in sent_at):
                if self.error is not None or not self.thread.is_alive():
                    raise SystemExit(f"{self.topic}: the consumer stopped: {self.error!r}")
                if time.monotonic() > deadline:
                    raise SystemExit(f"{self.topic}: {len(sent_at)} messages not done in {WAIT_S}s")
                self.cond.wait(0.5)
        end = max(self.done[mid] for mid in sent_at)
        return {
            "wall_s": end - t0,
            "latencies_ms": [(self.done[mid] - at) * 1000 for mid, at in sent_at.items()],
            "timings": [self.timings[mid] for mid in sent_at if mid in self.timings],
        }

    def check(self, total: int) -> None:
        """Every message got exactly the job's result on the reply topic."""
        want = spin_job(SPIN_ROWS, self.iterations)
        stats = self.consumer.stats  # a redelivery would time a retry, not the path measured
        assert stats.redelivered == 0 and stats.dead_lettered == 0, (self.topic, stats)
        replies = self.kafka.results(self.topic)
        assert len(replies) == total, (self.topic, len(replies), total)
        assert all(r["result"] == want for r in replies), replies[:2]


def bare_costs(iterations: int) -> dict[str, float]:
    """The job without any worker: the function in-process, and a bare host ``python3`` start-up
    (which a sandbox per message pays and a plain pool process does not)."""
    body, start = [], []
    for _ in range(10):
        t = time.perf_counter()
        spin_job(SPIN_ROWS, iterations)
        body.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        subprocess.run(["python3", "-c", "pass"], check=True, env={"PATH": "/usr/bin:/bin"})
        start.append((time.perf_counter() - t) * 1000)
    return {
        "job_in_process_ms": round(statistics.median(body), 1),
        "python3_startup_ms": round(statistics.median(start), 1),
    }


def sandbox_costs(client: Any, cpu: ServerCpu, server_pid: int, n: int = 10) -> dict[str, dict[str, float]]:
    """CPU ms per operation, one at a time, of the pieces of a sandboxed job: a sandbox's create and
    delete, an exec of ``true``, an exec of ``python3 -c pass``; split into the server's own process
    and the rest (the sandboxes' processes: bwrap, the guest agent, the exec's shells)."""

    def own() -> float:  # the server process alone (its threads), not the children it waited for
        return proc_cpu_s(server_pid, children=False)

    def measure(fn: Any) -> dict[str, float]:
        total0, own0 = cpu.seconds(), own()
        for _ in range(n):
            fn()
        total, mine = (cpu.seconds() - total0) / n * 1000, (own() - own0) / n * 1000
        return {
            "total_ms": round(total, 1),
            "server_ms": round(mine, 1),
            "sandbox_ms": round(total - mine, 1),
        }

    def create_delete() -> None:
        client.sandboxes.create(template=WORKER_TEMPLATE, ttl_seconds=120).kill()

    out = {"create_delete": measure(create_delete)}
    sb = client.sandboxes.create(template=WORKER_TEMPLATE, ttl_seconds=300)
    try:
        out["exec_true"] = measure(lambda: sb.exec("true", timeout_seconds=30))
        out["exec_python3"] = measure(lambda: sb.exec("python3 -c pass", timeout_seconds=30))
    finally:
        sb.kill()
    return out


def main() -> None:
    args = int_options(n=32, rounds=2, iterations=SPIN_ITERATIONS)
    from e2e.brokers import Kafka, broker_processes
    from pandastack_jobs import ConnectionConfig
    from pandastack_local import LocalServer

    start = machine()
    log(f"kafka: load average at start {start['load_avg']}")
    runs: dict[str, list[dict[str, Any]]] = {}
    cpu: dict[str, dict[str, float]] = {}
    with broker_processes() as group, LocalServer() as server:
        started = time.perf_counter()
        kafka = Kafka(group)
        log(f"kafka: broker up in {time.perf_counter() - started:.1f}s")
        conn = ConnectionConfig(api_url=server.url, api_key=server.api_key)
        server_pid = server.pid
        assert server_pid is not None
        server_cpu = ServerCpu(server_pid)
        broker_pid = group.get("kafka").pid
        bare = bare_costs(args.iterations)
        costs = sandbox_costs(server.client(), server_cpu, server_pid)
        log(f"kafka: CPU ms per operation: {costs}")
        for c in LEVELS:
            for variant in VARIANTS:
                name = f"{variant} c{c}"
                with Live(kafka, conn, variant, c, args.iterations) as live:
                    live.round(2 * c)  # warm-up: the group's join, imports, the server's pool
                    server0, self0 = server_cpu.seconds(), self_cpu_s()
                    broker0 = tree_cpu_s(broker_pid)
                    for _ in range(args.rounds):
                        time.sleep(0.5)  # the server's warm pool refills
                        runs.setdefault(name, []).append(live.round(args.n))
                    msgs = args.n * args.rounds
                    cpu[name] = {
                        "server_ms": round((server_cpu.seconds() - server0) / msgs * 1000, 1),
                        "consumer_ms": round((self_cpu_s() - self0) / msgs * 1000, 1),
                        "broker_ms": round((tree_cpu_s(broker_pid) - broker0) / msgs * 1000, 1),
                    }
                    live.check(2 * c + msgs)
                log(f"kafka: {name} done, load average {[round(x, 2) for x in os.getloadavg()]}")
        assert server.client().sandboxes.list() == [], "a variant leaked a sandbox"
    server_cpu.close()
    end = machine()
    log(f"kafka: load average at end {end['load_avg']}")
    data = report(runs, cpu, args.n)
    data.update(
        machine=start, finished=end, n=args.n, rounds=args.rounds, iterations=args.iterations,
        tenants=TENANTS, chunk=CHUNK, template=WORKER_TEMPLATE, bare=bare, costs=costs,
        server_cpu=server_cpu.method,
    )  # fmt: skip
    log(f"kafka written to {write_json('kafka', data)}")
    for lv in data["levels"]:
        log(
            f"  c={lv['concurrency']}: in-process {lv['inprocess_jobs_s']} jobs/s, K=1 {lv['k1_jobs_s']} "
            f"(p50 {lv['k1_p50_ms']} ms, p99 {lv['k1_p99_ms']} ms), K={CHUNK} {lv[f'k{CHUNK}_jobs_s']}; "
            f"K=1/in-process {lv['k1_vs_inprocess']}"
        )
    log(f"  K=1 phases (median ms) per concurrency: {data['phases']}; {bare}")


def report(runs: dict[str, list[dict[str, Any]]], cpu: dict[str, dict[str, float]], n: int) -> dict[str, Any]:
    """Median throughput per variant and level, latency percentiles over every message, the ratios,
    the K=1 path's median phase times per level and the CPU per message."""
    levels = []
    phases: dict[str, dict[str, float]] = {}
    for c in LEVELS:
        row: dict[str, Any] = {"concurrency": c}
        for variant in VARIANTS:
            name = f"{variant} c{c}"
            row |= rate_and_latency(runs[name], n, variant, "jobs")
            row[f"{variant}_server_cpu_ms"] = cpu[name]["server_ms"]
            row[f"{variant}_consumer_cpu_ms"] = cpu[name]["consumer_ms"]
            row[f"{variant}_broker_cpu_ms"] = cpu[name]["broker_ms"]
        for variant in VARIANTS[1:]:
            row[f"{variant}_vs_inprocess"] = ratio(row[f"{variant}_jobs_s"], row["inprocess_jobs_s"])
        levels.append(row)
        timings = [t for x in runs[f"k1 c{c}"] for t in x["timings"] if "run" in t]
        phases[str(c)] = {
            p: round(statistics.median(t[p] for t in timings) * 1000, 1) for p in PHASES if timings
        }
        if timings:  # the client and the reap look-ups before run_job's own phases
            phases[str(c)]["before"] = round(
                statistics.median(t["run"] - t["total"] for t in timings) * 1000, 1
            )
    return {"levels": levels, "phases": phases}


if __name__ == "__main__":
    main()
