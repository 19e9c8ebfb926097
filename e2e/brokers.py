"""The real brokers of the queue tests, started from nothing on loopback and free ports.

Redis (with AOF, so a restart keeps the stream), PostgreSQL, RabbitMQ (its own
epmd, as the ``rabbitmq`` user), moto's SQS-compatible server and Apache Kafka
(KRaft, its jars fetched once by tests/queue/kafka/jars.sh), each under
the run's :class:`e2e.procs.ProcessGroup`, which logs them and records their
process groups for ``tests/queue/run.sh`` to kill whatever is left. Each broker
also reads back what the consumer wrote (results, dead letters, depth) with its
own client library.
"""

from __future__ import annotations

import base64
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from e2e.procs import ProcessGroup, free_port, port_open, run
from e2e.proxy import Relay
from pandastack_local.testing.waiting import wait_for

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        raise AssertionError(f"PostgreSQL's {name} not found: run `make test-queue` (it installs postgresql)")
    return found[-1]


class Broker:
    """One running broker; subclasses start it and read its queues back."""

    name = ""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.port = free_port()
        self.dir = group.run_dir / self.name
        self.dir.mkdir(mode=0o755)
        self._start_kw: dict[str, Any] = {}

    def _start(self, argv: list[str], **kw: Any) -> None:
        self._argv, self._start_kw = argv, kw
        self.group.start(self.name, argv, ports=[self.port], **kw)
        wait_for(
            f"{self.name} to listen",
            lambda: port_open(self.port) and self.ready(),
            timeout=90,
            interval=0.2,
            on_timeout=lambda: self.group.get(self.name).tail(),
        )

    def ready(self) -> bool:
        return True

    def stop(self) -> None:
        proc = self.group.get(self.name)
        proc.stop(grace=30)
        self.group.procs.remove(proc)

    def down(self) -> None:
        """Stop the broker (its clean shutdown); :meth:`up` starts it again on the same port and data."""
        self.stop()

    def up(self) -> None:
        self._start(self._argv, **self._start_kw)

    def restart(self, down_seconds: float = 0.0) -> None:
        """Down for ``down_seconds``, then up again."""
        self.down()
        time.sleep(down_seconds)
        self.up()

    def url(self, queue: str) -> str:
        raise NotImplementedError

    def transport(self, queue: str, lease: float = 60.0) -> Any:
        from pandastack_jobs.queue import open_transport

        t = open_transport(self.url(queue), lease)
        t.connect()
        return t

    def results(self, queue: str) -> list[dict[str, Any]]:
        """Every reply so far (decoded JSON), oldest first."""
        raise NotImplementedError

    def dead(self, queue: str) -> list[dict[str, Any]]:
        """Every dead letter so far: ``{"body": bytes, "why": {...}}``."""
        raise NotImplementedError

    def depth(self, queue: str) -> int:
        """Messages still in the queue (waiting, delayed or leased)."""
        raise NotImplementedError


class Redis(Broker):
    name = "redis"

    def __init__(self, group: ProcessGroup) -> None:
        super().__init__(group)
        exe = shutil.which("redis-server") or "/usr/bin/redis-server"
        self._start(
            [
                exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--dir",
                str(self.dir),
                "--protected-mode",
                "yes",
            ]
        )
        import redis

        self.r = redis.Redis(port=self.port)

    def url(self, queue: str) -> str:
        return f"redis://127.0.0.1:{self.port}/0?stream={queue}&group=workers"

    def results(self, queue: str) -> list[dict[str, Any]]:
        return [json.loads(f[b"body"]) for _, f in self.r.xrange(f"{queue}:results")]

    def dead(self, queue: str) -> list[dict[str, Any]]:
        return [{"body": f[b"body"], "why": json.loads(f[b"why"])} for _, f in self.r.xrange(f"{queue}:dead")]

    def depth(self, queue: str) -> int:
        return int(self.r.xlen(queue)) + int(self.r.zcard(f"{queue}:delayed"))


class Postgres(Broker):
    name = "postgres"

    def __init__(self, group: ProcessGroup) -> None:
        super().__init__(group)
        shutil.chown(self.dir, "postgres", "postgres")
        data = self.dir / "data"
        run(
            [_pg_bin("initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "--no-sync"],
            user="postgres",
            timeout=120,
            log=group.log_dir / "initdb.log",
        )
        self._start(
            [
                _pg_bin("postgres"),
                "-D",
                str(data),
                "-p",
                str(self.port),
                "-h",
                "127.0.0.1",
                "-k",
                str(self.dir),
                "-c",
                "fsync=off",
                "-c",
                "max_connections=100",
            ],
            user="postgres",
            stop_signal=signal.SIGINT,
        )

    def ready(self) -> bool:
        return (
            subprocess.run(
                [_pg_bin("pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                capture_output=True,
                timeout=10,
            ).returncode
            == 0
        )

    def url(self, queue: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres?queue={queue}"

    def _rows(self, query: str, queue: str) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.url(queue).split("?")[0], autocommit=True) as conn:
            return conn.execute(query, (queue,)).fetchall()

    def results(self, queue: str) -> list[dict[str, Any]]:
        rows = self._rows("SELECT body FROM pandastack_queue_results WHERE queue = %s ORDER BY id", queue)
        return [json.loads(bytes(b)) for (b,) in rows]

    def dead(self, queue: str) -> list[dict[str, Any]]:
        rows = self._rows("SELECT body, why FROM pandastack_queue_dead WHERE queue = %s ORDER BY id", queue)
        return [{"body": bytes(b), "why": w} for b, w in rows]

    def depth(self, queue: str) -> int:
        return int(self._rows("SELECT count(*) FROM pandastack_queue WHERE queue = %s", queue)[0][0])


class RabbitMQ(Broker):
    name = "rabbitmq"

    def __init__(self, group: ProcessGroup) -> None:
        super().__init__(group)
        shutil.chown(self.dir, "rabbitmq", "rabbitmq")
        epmd_port, dist_port = free_port(), free_port()
        (self.dir / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.port}\nloopback_users = none\n"
        )
        env = {
            "E2E_RUN_DIR": str(group.run_dir),  # run.sh's leftover check finds them by it
            "PATH": "/usr/bin:/bin",
            "HOME": str(self.dir),
            "LANG": "C.UTF-8",
            "ERL_EPMD_PORT": str(epmd_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODENAME": f"pq{self.port}@localhost",
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq"),
            "RABBITMQ_LOGS": "-",
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
        }
        # Its own epmd in the foreground (rabbitmq would start a daemon that outlives the run).
        group.start(
            "epmd",
            ["epmd", "-port", str(epmd_port), "-address", "127.0.0.1"],
            env=env,
            user="rabbitmq",
            ports=[epmd_port],
        )
        wait_for("epmd to listen", lambda: port_open(epmd_port), timeout=30, interval=0.1)
        self._start(["/usr/lib/rabbitmq/bin/rabbitmq-server"], env=env, user="rabbitmq")
        self._conn: Any = None
        self._seen: dict[str, list[Any]] = {}

    def url(self, queue: str) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/%2F?queue={queue}"

    def down(self) -> None:
        self._conn = None
        super().down()

    def _channel(self) -> Any:
        import pika

        if self._conn is not None and self._conn.is_open:
            try:
                return self._conn.channel()
            except pika.exceptions.AMQPConnectionError:
                pass  # idle through a test (no heartbeats serviced): the broker dropped it
        self._conn = pika.BlockingConnection(
            pika.URLParameters(f"amqp://guest:guest@127.0.0.1:{self.port}/%2F")
        )
        return self._conn.channel()

    def _drain(self, name: str) -> list[Any]:
        seen = self._seen.setdefault(name, [])
        ch = self._channel()
        try:
            ch.queue_declare(name, passive=True)
        except Exception:  # not declared yet: nothing in it
            return seen
        while True:
            method, props, body = ch.basic_get(name, auto_ack=True)
            if method is None:
                break
            seen.append((props, body))
        ch.close()
        return seen

    def results(self, queue: str) -> list[dict[str, Any]]:
        return [json.loads(body) for _, body in self._drain(f"{queue}.results")]

    def dead(self, queue: str) -> list[dict[str, Any]]:
        from pandastack_jobs.queue.rabbitmq import dead_reason

        return [
            {"body": body, "why": dead_reason(props.headers)} for props, body in self._drain(f"{queue}.dead")
        ]

    def depth(self, queue: str) -> int:
        ch = self._channel()
        total = 0
        delays = [f"{queue}.work.delay.{ms}" for ms in (1000, 2000, 5000, 10000, 30000)]
        names = [queue, f"{queue}.work", *delays]
        for name in names:
            try:
                total += ch.queue_declare(name, passive=True).method.message_count
            except Exception:  # not declared: empty (the channel is closed by it)
                ch = self._channel()
        return total


class SQS(Broker):
    """moto's server: SQS-compatible. It keeps its queues in memory (a restart would be a new, empty
    broker), so :meth:`restart` is an outage instead: the consumer reaches moto through a
    :class:`Relay` that drops every connection and refuses new ones while "down"."""

    name = "sqs"

    def __init__(self, group: ProcessGroup) -> None:
        super().__init__(group)
        os.environ.update(AWS_ENV)
        self.moto_port = free_port()
        argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.moto_port)]
        group.start("moto", argv, env={**os.environ, **AWS_ENV}, ports=[self.moto_port])
        wait_for("moto to listen", lambda: port_open(self.moto_port), timeout=60, interval=0.2)
        self.relay = Relay(self.port, self.moto_port)
        import boto3

        endpoint = f"http://127.0.0.1:{self.moto_port}"
        self.client = boto3.client("sqs", endpoint_url=endpoint, region_name="us-east-1")
        self._seen: dict[str, list[dict[str, Any]]] = {}

    def down(self) -> None:
        self.relay.cut()

    def up(self) -> None:
        self.relay.restore()

    def url(self, queue: str) -> str:
        return f"sqs://{queue}?endpoint_url=http://127.0.0.1:{self.port}&region=us-east-1&redrive_after=10"

    def _drain(self, name: str) -> list[dict[str, Any]]:
        seen = self._seen.setdefault(name, [])
        try:
            url = self.client.get_queue_url(QueueName=name)["QueueUrl"]
        except self.client.exceptions.QueueDoesNotExist:
            return seen
        while True:
            got = self.client.receive_message(
                QueueUrl=url, MaxNumberOfMessages=10, MessageAttributeNames=["All"]
            )
            msgs = got.get("Messages", [])
            if not msgs:
                return seen
            for m in msgs:
                seen.append(m)
                self.client.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])

    def results(self, queue: str) -> list[dict[str, Any]]:
        return [json.loads(m["Body"]) for m in self._drain(f"{queue}-results")]

    def dead(self, queue: str) -> list[dict[str, Any]]:
        out = []
        for m in self._drain(f"{queue}-dead"):
            why = m.get("MessageAttributes", {}).get("why", {}).get("StringValue")
            out.append({"body": m["Body"].encode(), "why": json.loads(why) if why else {}})
        return out

    def depth(self, queue: str) -> int:
        url = self.client.get_queue_url(QueueName=queue)["QueueUrl"]
        names = [
            "ApproximateNumberOfMessages",
            "ApproximateNumberOfMessagesNotVisible",
            "ApproximateNumberOfMessagesDelayed",
        ]
        attrs = self.client.get_queue_attributes(QueueUrl=url, AttributeNames=names)["Attributes"]
        return sum(int(attrs.get(n, 0)) for n in names)


class Kafka(Broker):
    """Apache Kafka itself (KRaft, one node as broker and controller), from the jars
    tests/queue/kafka/jars.sh resolves (cached), on ``java -cp``: a small heap, one CPU's worth of
    threads, two partitions per topic, short group timeouts, so it starts in seconds."""

    name = "kafka"

    def __init__(self, group: ProcessGroup) -> None:
        super().__init__(group)
        jars = kafka_jars()
        self.controller_port = free_port()
        props = self.dir / "server.properties"
        props.write_text(
            "\n".join(
                [
                    "process.roles=broker,controller",
                    "node.id=1",
                    f"controller.quorum.voters=1@127.0.0.1:{self.controller_port}",
                    f"listeners=PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
                    f"advertised.listeners=PLAINTEXT://127.0.0.1:{self.port}",
                    "controller.listener.names=CONTROLLER",
                    "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
                    f"log.dirs={self.dir / 'data'}",
                    "num.partitions=2",
                    "offsets.topic.replication.factor=1",
                    "offsets.topic.num.partitions=2",
                    "transaction.state.log.replication.factor=1",
                    "transaction.state.log.min.isr=1",
                    "share.coordinator.state.topic.replication.factor=1",
                    "group.initial.rebalance.delay.ms=0",
                    "group.min.session.timeout.ms=1000",
                    "num.network.threads=2",
                    "num.io.threads=2",
                    "background.threads=2",
                    "log.flush.interval.messages=1",
                    "",
                ]
            )
        )
        java = shutil.which("java") or "java"
        jvm = [java, "-Xmx256m", "-Xms64m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1"]
        jvm += ["-Dorg.slf4j.simpleLogger.defaultLogLevel=warn", "-cp", f"{jars}/*"]
        cluster = "-"
        while cluster.startswith("-"):  # one in 64 would read as an option (Kafka's own ids never do)
            cluster = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        run(
            [*jvm, "kafka.tools.StorageTool", "format", "-t", cluster, "-c", str(props)],
            timeout=120,
            log=group.log_dir / "kafka-format.log",
        )
        self._start([*jvm, "kafka.Kafka", str(props)])

    def ready(self) -> bool:
        from confluent_kafka.admin import AdminClient

        try:
            AdminClient({"bootstrap.servers": f"127.0.0.1:{self.port}"}).list_topics(timeout=2)
        except Exception:  # not up yet
            return False
        return True

    def url(self, queue: str) -> str:
        # A group per queue (a classic group's rebalance waits for every member, whatever topic
        # it reads); short group timeouts: a SIGKILLed consumer's partitions move within seconds.
        return (
            f"kafka://127.0.0.1:{self.port}?topic={queue}&group={queue}-workers&partitions=2"
            "&session.timeout.ms=3000&heartbeat.interval.ms=500"
        )

    def records(self, topic: str) -> list[Any]:
        """Every record of ``topic`` so far, oldest first per partition."""
        from confluent_kafka import Consumer, TopicPartition

        c = Consumer(
            {"bootstrap.servers": f"127.0.0.1:{self.port}", "group.id": f"reader-{uuid.uuid4().hex[:6]}"}
        )
        try:
            meta = c.list_topics(topic, timeout=10).topics.get(topic)
            if meta is None or not meta.partitions:
                return []
            out: list[Any] = []
            for p in sorted(meta.partitions):
                low, high = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
                if high <= low:
                    continue
                c.assign([TopicPartition(topic, p, low)])
                got: list[Any] = []
                deadline = time.monotonic() + 10
                while len(got) < high - low and time.monotonic() < deadline:
                    got += [m for m in c.consume(high - low - len(got), 0.5) if m.error() is None]
                out += got
            return out
        finally:
            c.close()

    def results(self, queue: str) -> list[dict[str, Any]]:
        return [json.loads(m.value()) for m in self.records(f"{queue}.results")]

    def dead(self, queue: str) -> list[dict[str, Any]]:
        from pandastack_jobs.queue.kafka import dead_reason

        return [{"body": m.value(), "why": dead_reason(m.headers())} for m in self.records(f"{queue}.dead")]

    def produce(
        self, queue: str, body: bytes, partition: int = 0, headers: dict[str, str] | None = None
    ) -> None:
        """A record straight onto one partition of the topic, as any producer could write it."""
        from confluent_kafka import Producer

        p = Producer({"bootstrap.servers": f"127.0.0.1:{self.port}"})
        p.produce(queue, value=body, partition=partition, headers=list((headers or {}).items()))
        assert p.flush(10) == 0

    def committed(self, queue: str) -> dict[int, int]:
        """The group's committed offset per partition of the topic (-1: none yet)."""
        from confluent_kafka import Consumer, TopicPartition

        c = Consumer({"bootstrap.servers": f"127.0.0.1:{self.port}", "group.id": f"{queue}-workers"})
        try:
            tps = [TopicPartition(queue, p) for p in (0, 1)]
            return {tp.partition: max(tp.offset, -1) for tp in c.committed(tps, timeout=10)}
        finally:
            c.close()

    def depth(self, queue: str) -> int:
        """Records past the groups' committed offsets, in the topic and its retry topic."""
        from confluent_kafka import Consumer, TopicPartition

        total = 0
        for topic, group in ((queue, f"{queue}-workers"), (f"{queue}.retry", f"{queue}-workers.retry")):
            c = Consumer({"bootstrap.servers": f"127.0.0.1:{self.port}", "group.id": group})
            try:
                meta = c.list_topics(topic, timeout=10).topics.get(topic)
                tps = [TopicPartition(topic, p) for p in sorted(meta.partitions)] if meta else []
                for tp in c.committed(tps, timeout=10) if tps else []:
                    low, high = c.get_watermark_offsets(tp, timeout=10)
                    total += high - (tp.offset if tp.offset >= 0 else low)
            finally:
                c.close()
        return total


def kafka_jars() -> Path:
    """The directory of Kafka's jars (fetched with Maven the first time, then cached)."""
    script = Path(__file__).resolve().parent.parent / "tests" / "queue" / "kafka" / "jars.sh"
    out = subprocess.run([str(script)], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise AssertionError(f"fetching Kafka's jars failed: {out.stderr}")
    return Path(out.stdout.strip())


KINDS: dict[str, type[Broker]] = {
    "redis": Redis,
    "postgres": Postgres,
    "rabbitmq": RabbitMQ,
    "sqs": SQS,
    "kafka": Kafka,
}


def run_dir() -> Path:
    """A fresh directory for this pytest process's brokers, inside the one ``tests/queue/run.sh``
    made when it runs (its cleanup reads every ``*/pgids`` there), else in /tmp."""
    import tempfile

    base = os.environ.get("QUEUE_RUN_DIR")
    path = Path(tempfile.mkdtemp(prefix="brokers-", dir=base))
    path.chmod(0o755)  # the brokers run as their own users (postgres, rabbitmq)
    return path


@contextmanager
def broker_processes() -> Iterator[ProcessGroup]:
    """A :class:`ProcessGroup` in a fresh :func:`run_dir`; every process it started is stopped on
    the way out, whatever happened (the fixtures of tests/queue, tests/celery_tasks and
    tests/observability start their brokers in one)."""
    group = ProcessGroup(run_dir())
    try:
        yield group
    finally:
        group.stop_all()


class LazyBrokers:
    """The brokers of one pytest session, each started once, when a test first asks for it, in one
    :class:`ProcessGroup` (``group``: the tests start their workers in it too)."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.started: dict[str, Broker] = {}

    def get(self, kind: str, cls: type[Broker] | None = None) -> Broker:
        """The broker ``kind`` (of ``cls``, else :data:`KINDS`'s class), started on first use."""
        if kind not in self.started:
            self.started[kind] = (cls or KINDS[kind])(self.group)
        return self.started[kind]


@contextmanager
def lazy_brokers() -> Iterator[LazyBrokers]:
    """:class:`LazyBrokers` in :func:`broker_processes`: all of them stopped on the way out."""
    with broker_processes() as group:
        yield LazyBrokers(group)
