"""The demo's queue part: twenty messages on a real Redis stream through the core consumer.

Honest tenants' jobs are acked once their result is on the reply stream; hostile tenants
(a fork bomb, a memory hog, a job past its timeout, a disk filler), a malformed message,
a poison message and a flaky one are redelivered or dead-lettered, each with its reason.
What the summary shows is read back from the broker (the reply and dead-letter streams), not
from the consumer's memory, and every message is checked against what it should end as.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pandastack_jobs import ConnectionConfig
from pandastack_jobs.queue import Consumer, Stats, open_transport

STREAM = "demo-jobs"
CONCURRENCY = 4
MAX_DELIVERIES = 2
DEFAULTS = {"template": "base", "timeout": 20}
RELEASE_DELAY = 0.5
IDLE_SECONDS = 5.0  # nothing running, received or settled, and PandaStack answering: the batch is over

HONEST_JOB = """\
import json, os
rows = json.load(open(os.environ["JOB_INPUT"]))
total = round(sum(r["amount"] for r in rows), 2)
result = {"tenant": os.environ["TENANT"], "rows": len(rows), "total": total}
json.dump(result, open(os.environ["JOB_RESULT"], "w"))
"""
FORK_BOMB = """\
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
MEMORY_HOG = """\
hog = []
while True:
    hog.append(bytearray(64 * 1024 * 1024))
"""
POISON_JOB = """\
import json, os
rows = json.load(open(os.environ["JOB_INPUT"]))
print("average", sum(r["amount"] for r in rows) / len(rows))  # no rows: ZeroDivisionError, every time
"""
HONEST_TENANTS = (
    "acme", "globex", "initech", "umbrella", "hooli", "stark", "wayne",
    "wonka", "tyrell", "cyberdyne", "soylent", "oscorp", "vandelay",
)  # fmt: skip


@dataclass(frozen=True)
class Expect:
    """What one message must end as: ``acked`` or ``dead-lettered``, after how many deliveries,
    and (dead letters) the kind of failure."""

    outcome: str
    deliveries: int
    kind: str | None = None


def rows_for(tenant: str) -> list[dict[str, float]]:
    seed = sum(map(ord, tenant))
    return [{"id": i, "amount": round(5 + (seed * (i + 3)) % 240 + i / 10, 2)} for i in range(1, 11)]


def _msg(mid: str, tenant: str, command: str, **more: Any) -> bytes:
    doc: dict[str, Any] = {"id": mid, "tenant": tenant, "command": command, **more}
    return json.dumps(doc).encode()


def _honest(i: int, tenant: str) -> tuple[str, bytes, Expect]:
    """Honest tenant number ``i``'s message: its own rows and TENANT, acked on the first delivery."""
    mid = f"{tenant}-{i}"
    body = _msg(
        mid,
        tenant,
        "python3 job.py",
        files={"job.py": HONEST_JOB},
        input=rows_for(tenant),
        options={"env": {"TENANT": tenant}},
    )
    return mid, body, Expect("acked", 1)


def messages() -> list[tuple[str, bytes, Expect]]:
    """The demo's messages, in the order they are sent: ``(id, body, expected)``."""
    out = [_honest(i, tenant) for i, tenant in enumerate(HONEST_TENANTS[:6])]
    hostile = [
        # The pids limit stops the bomb from spreading; the timeout ends it. The producer's policy for
        # this tenant: a timeout is final (retry_on_timeout false), so no second bomb.
        ("evil-fork-bomb", FORK_BOMB, {"timeout": 4, "retry_on_timeout": False},
         Expect("dead-lettered", 1, "timeout")),
        # The memory cgroup's OOM killer ends it (exit 137), which the producer marks as permanent.
        ("evil-memory-hog", MEMORY_HOG, {"permanent_exit_codes": [137]},
         Expect("dead-lettered", 1, "permanent_exit_code")),
    ]  # fmt: skip
    for mid, code, options, expect in hostile:
        out.append((mid, _msg(mid, mid, "python3 job.py", files={"job.py": code}, options=options), expect))
    out += [_honest(i, tenant) for i, tenant in enumerate(HONEST_TENANTS[6:], 6)]
    out += [
        # Past its timeout on every delivery: redelivered once, then dead-lettered (max_deliveries=2).
        ("evil-sleeper", _msg("evil-sleeper", "evil-sleeper", "sleep 600", options={"timeout": 2}),
         Expect("dead-lettered", 2, "timeout")),
        # Fills its disk (the sandbox's size-capped tmpfs) until ENOSPC: exit 1, redelivered, then dead.
        ("evil-disk-filler", _msg("evil-disk-filler", "evil-disk-filler",
                                  "dd if=/dev/zero of=/work/fill bs=1M status=none"),
         Expect("dead-lettered", 2, "exit_code")),
        # A typo'd field: dead-lettered at once, naming the field, never reaching a sandbox.
        ("malformed", json.dumps({"id": "malformed", "comand": "echo hi"}).encode(),
         Expect("dead-lettered", 1, "malformed")),
        # Poison: its input makes the job fail every time; dead-lettered after max_deliveries.
        ("poison", _msg("poison", "poison", "python3 job.py", files={"job.py": POISON_JOB}, input=[]),
         Expect("dead-lettered", 2, "exit_code")),
        # Flaky: fails redeliverably on its first delivery (a dependency was down), then succeeds.
        ("flaky", _msg("flaky", "flaky",
                       '[ "$QUEUE_DELIVERY" -ge 2 ] || { echo "upstream unavailable" >&2; exit 75; }; '
                       'echo "{\\"delivery\\": $QUEUE_DELIVERY}" > "$JOB_RESULT"'),
         Expect("acked", 2)),
    ]  # fmt: skip
    return out


@dataclass
class QueueRow:
    """One message as the broker ended it."""

    id: str
    outcome: str  # "acked", "dead-lettered" or "missing"
    deliveries: int
    kind: str | None = None
    reason: str = ""
    result: Any = None


@dataclass
class QueueSummary:
    stats: dict[str, int]
    rows: list[QueueRow]
    seconds: float
    left_in_queue: int
    problems: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The printed summary: the counts, the acked messages, then each dead letter with its reason."""
        s = self.stats
        acked = [r for r in self.rows if r.outcome == "acked"]
        others = [r for r in self.rows if r.outcome != "acked"]
        out = [
            f"acked {s['acked']}  redelivered {s['redelivered']}  dead-lettered {s['dead_lettered']}  "
            f"({len(self.rows)} messages, {s['received']} deliveries, {self.seconds:.0f} s; "
            f"left in the queue: {self.left_in_queue})",
            "  acked (result on the reply stream, then XACK):",
        ]
        for r in acked:
            out.append(f"    {r.id:<18} delivery {r.deliveries}  {json.dumps(r.result)}")
        out.append("  dead-lettered (on the dead-letter stream, with the reason):")
        for r in others:
            out.append(f"    {r.id:<18} deliveries {r.deliveries}  [{r.kind}] {_clip(r.reason, 150)}")
        return out


def _clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def batch_over(messages: int, deadline: float) -> Callable[[Stats], bool]:
    """The demo's stop rule: every message settled, the deadline passed, or idle for longer than
    any redelivery delay (a message was lost: reported as missing). While PandaStack is down the
    consumer has paused pulling and holds the messages back uncharged: that is waiting, not idle,
    and the idle clock starts again when it answers."""
    resumed = float("-inf")

    def over(stats: Stats) -> bool:
        nonlocal resumed
        now = time.monotonic()
        if stats.acked + stats.dead_lettered >= messages or now > deadline:
            return True
        if stats.api_down_since is not None:
            resumed = now
            return False
        return stats.in_flight == 0 and now - max(stats.last_activity, resumed) > IDLE_SECONDS

    return over


def run_queue_demo(redis_url: str, connection: ConnectionConfig, timeout: float = 240.0) -> QueueSummary:
    """Send the messages to a fresh stream on ``redis_url``, consume them, read the outcome back."""
    import redis

    url = f"{redis_url}?stream={STREAM}"
    sent = messages()
    producer = open_transport(url)
    producer.connect()
    try:
        for mid, body, _ in sent:
            producer.send(body, message_id=mid)
    finally:
        producer.close()
    consumer = Consumer(
        open_transport(url, lease_seconds=30),
        connection,
        concurrency=CONCURRENCY,
        max_deliveries=MAX_DELIVERIES,
        defaults=DEFAULTS,
        release_delay=RELEASE_DELAY,
        poll_seconds=0.3,
        drain_seconds=10,
    )
    started = time.monotonic()
    stats = consumer.run(batch_over(len(sent), started + timeout))
    seconds = time.monotonic() - started
    r: Any = redis.Redis.from_url(redis_url)
    try:
        results: dict[str, list[dict[str, Any]]] = {}
        for _, f in r.xrange(f"{STREAM}:results"):
            doc = json.loads(f[b"body"])
            results.setdefault(doc["id"], []).append(doc)
        dead: dict[str, list[dict[str, Any]]] = {}
        for _, f in r.xrange(f"{STREAM}:dead"):
            # The dead letter's mid is the broker's id; the producer's id is in the body.
            dead.setdefault(json.loads(f[b"body"])["id"], []).append(json.loads(f[b"why"]))
        left = int(r.xlen(STREAM)) + int(r.zcard(f"{STREAM}:delayed"))
    finally:
        r.close()
    summary = QueueSummary(stats.as_dict(), [], seconds, left)
    for mid, _, expect in sent:
        got_results, got_dead = results.get(mid, []), dead.get(mid, [])
        if got_results:
            row = QueueRow(mid, "acked", int(got_results[0]["delivery"]), result=got_results[0]["result"])
        elif got_dead:
            why = got_dead[0]
            deliveries = int(why.get("deliveries") or 0)
            row = QueueRow(mid, "dead-lettered", deliveries, why.get("kind"), why["reason"])
        else:
            row = QueueRow(mid, "missing", 0)
        summary.rows.append(row)
        if len(got_results) + len(got_dead) > 1:
            summary.problems.append(f"{mid}: settled {len(got_results) + len(got_dead)} times, expected once")
        got = (row.outcome, row.deliveries, row.kind if row.outcome == "dead-lettered" else None)
        if got != (expect.outcome, expect.deliveries, expect.kind):
            summary.problems.append(
                f"{mid}: expected {expect.outcome} after {expect.deliveries} deliveries"
                f"{f' ({expect.kind})' if expect.kind else ''}, got {row.outcome} after {row.deliveries}"
                f"{f' ({row.kind}: {row.reason})' if row.kind else ''}"
            )
        if row.outcome == "acked" and mid.split("-")[0] in HONEST_TENANTS:
            tenant = mid.rsplit("-", 1)[0]
            want = round(sum(x["amount"] for x in rows_for(tenant)), 2)
            if row.result != {"tenant": tenant, "rows": 10, "total": want}:
                summary.problems.append(f"{mid}: wrong result {row.result!r}")
    if left:
        summary.problems.append(f"{left} message(s) left in the queue")
    return summary


def main(log_dir: Path, connection: ConnectionConfig, say: Any = print) -> QueueSummary:
    """The demo's queue part on a Redis it starts and stops (installed with apt when missing);
    the consumer's log goes to ``log_dir/queue.log``."""
    from .redis_server import ensure_redis_server, redis_server

    exe = ensure_redis_server(say)
    logger = logging.getLogger("pandastack_jobs.queue")
    handler = logging.FileHandler(log_dir / "queue.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    saved = (logger.propagate, logger.level)
    logger.addHandler(handler)
    logger.propagate, logger.level = False, logging.INFO
    try:
        with redis_server(log_dir / "redis.log", exe) as url:
            shown = url.split("@", 1)[-1]  # no password on the screen
            say(
                f"  Redis redis://{shown} (temporary, password-protected, stopped after this part); "
                f"stream {STREAM!r}"
            )
            say(
                f"  {len(messages())} messages, concurrency {CONCURRENCY}, "
                f"max_deliveries {MAX_DELIVERIES}, template {DEFAULTS['template']!r} ..."
            )
            return run_queue_demo(url, connection)
    finally:
        logger.removeHandler(handler)
        handler.close()
        logger.propagate, logger.level = saved
