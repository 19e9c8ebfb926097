"""``pandastack-jobs consume`` and ``pandastack-jobs send``: a queue worker for users with a broker
and no engine.

The PandaStack server and key come from the SDK's environment
(``PANDASTACK_API``, ``PANDASTACK_API_KEY``), never from the command line, so
the key shows in no process list. ``consume`` prints which API it uses (the
hosted one when ``PANDASTACK_API`` is unset) and checks it answers and takes the
key before it pulls anything.

Exit codes: 0 stopped (SIGTERM/SIGINT, drained); 2 a bad argument; 3 the broker
cannot be reached; 4 the PandaStack API cannot be reached at the start; 5 the
PandaStack API refused the key (or there is none).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from collections.abc import Sequence

from pandastack_workflows.install import install_line

from .. import tracing
from ..connection import ConnectionConfig
from . import BrokerUnavailable, Consumer, Transport, open_transport
from .consumer import CONSUMER_DEFAULTS as D
from .metrics import messaging_system
from .outage import EXIT_API_KEY_REJECTED, EXIT_API_UNREACHABLE, ApiCheckError, describe_api, probe
from .transport import DeadLettersUnsupported, UnknownDeadLetter

EXAMPLES = f"""PandaStack: PANDASTACK_API (the hosted API when unset) and PANDASTACK_API_KEY.
exit codes: 0 stopped, 2 bad argument, 3 broker unreachable,
  {EXIT_API_UNREACHABLE} PandaStack API unreachable, {EXIT_API_KEY_REJECTED} its key refused or missing
brokers:
  redis://127.0.0.1:6379/0?stream=jobs&group=pandastack   (redis://:PASSWORD@host:6379/0?... with a password)
  postgresql://user@127.0.0.1:5432/db?queue=jobs&table=pandastack_queue
  amqp://guest:guest@127.0.0.1:5672/%2F?queue=jobs
  sqs://jobs?region=eu-west-1                (endpoint_url=... for an SQS-compatible server)
  kafka://127.0.0.1:9092?topic=jobs&group=pandastack   (order=key: one tenant's messages in order)
  memory://jobs                              (this process only: for trying things out)
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pandastack-jobs", epilog=EXAMPLES, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "consume", help="run one sandbox per message; ack after the result is out", epilog=EXAMPLES
    )
    c.add_argument("--broker", default=os.environ.get("PANDASTACK_QUEUE_BROKER"), help="broker URL")
    c.add_argument(
        "--concurrency",
        type=int,
        default=D.concurrency,
        help=f"jobs running at once (default {D.concurrency})",
    )
    c.add_argument("--template", help="default sandbox template (a message's options.template wins)")
    c.add_argument("--timeout", type=float, help="default job timeout in seconds")
    c.add_argument(
        "--allow-template",
        action="append",
        dest="allowed_templates",
        metavar="NAME",
        help="a template messages may name (repeat; default: any); --template is always allowed",
    )
    # The consumer's settings whose help ends with their default (ConsumerSettings').
    tunables: list[tuple[str, type, float, str]] = [
        ("--lease", float, D.lease_seconds, "visibility/claim timeout, s"),
        ("--max-deliveries", int, D.max_deliveries, "dead-letter after this many"),
        ("--release-delay", float, D.release_delay, "least redelivery delay, s"),
        ("--drain", float, D.drain_seconds, "SIGTERM: seconds to let jobs finish"),
    ]
    for flag, kind, default, text in tunables:
        c.add_argument(flag, type=kind, default=default, help=f"{text} (default {default:g})")
    c.add_argument(
        "--max-message-bytes", type=int, default=1024 * 1024, help="larger messages are dead-lettered"
    )
    c.add_argument(
        "--chunk-size",
        type=int,
        default=D.chunk_size,
        metavar="K",
        help=f"run up to K messages of one isolation key in one sandbox, in turn (default {D.chunk_size})",
    )
    c.add_argument(
        "--chunk-key",
        default=D.chunk_key,
        help=f"the isolation key of a chunk: 'tenant' or 'input.<name>' (default {D.chunk_key!r})",
    )
    c.add_argument(
        "--chunk-keyless",
        action="store_true",
        help="let messages without the key share sandboxes with each other (default: each alone)",
    )
    c.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (default: off; 0 picks a free port)",
    )
    c.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="the address --metrics-port listens on (default 127.0.0.1; 0.0.0.0 for a scraper elsewhere)",
    )
    c.add_argument("--progress-every", type=float, default=None, help="seconds between progress lines")
    c.add_argument("--quiet", action="store_true", help="no progress line")
    c.add_argument("--log-level", default="WARNING")
    s = sub.add_parser(
        "send", help="enqueue messages: each argument, or each line of stdin, is one JSON message"
    )
    s.add_argument("--broker", default=os.environ.get("PANDASTACK_QUEUE_BROKER"), help="broker URL")
    s.add_argument("messages", nargs="*")
    dl = sub.add_parser(
        "dead-letters",
        help="list the queue's dead letters (both ids, kind, reason), or --requeue one",
        epilog=EXAMPLES,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    dl.add_argument("--broker", default=os.environ.get("PANDASTACK_QUEUE_BROKER"), help="broker URL")
    dl.add_argument("--limit", type=int, default=100, help="list at most N (default 100)")
    dl.add_argument("--json", action="store_true", help="one JSON object per line, body included")
    dl.add_argument(
        "--requeue",
        metavar="BROKER_ID",
        help="put this dead letter back on the queue as a new message (delivery 1); "
        "its dead letter is kept, marked requeued",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper() if args.command == "consume" else "WARNING", stream=sys.stderr
    )
    if args.command != "consume" or args.log_level.upper() != "DEBUG":
        logging.getLogger("pika").setLevel(logging.CRITICAL)  # it logs a traceback per failed connect
    if not args.broker:
        print("pandastack-jobs: give --broker URL (or set PANDASTACK_QUEUE_BROKER)", file=sys.stderr)
        return 2
    try:
        transport = open_transport(args.broker, getattr(args, "lease", 60.0))
    except ValueError as exc:
        print(f"pandastack-jobs: --broker: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(
            f"pandastack-jobs: {exc}: the brokers' clients are the [queue] extra: {install_line('queue')}",
            file=sys.stderr,
        )
        return 2
    try:
        transport.connect()
    except BrokerUnavailable as exc:
        print(f"pandastack-jobs: cannot reach the broker: {exc}", file=sys.stderr)
        return 3
    if args.command == "send":
        return _send(transport, args.messages)
    if args.command == "dead-letters":
        return _dead_letters(transport, args)
    return _consume(transport, args)


def _send(transport: Transport, messages: list[str]) -> int:
    lines = messages or [line for line in sys.stdin.read().splitlines() if line.strip()]
    system = messaging_system(transport)
    for line in lines:
        # A PRODUCER span per message (with OpenTelemetry configured); its context rides on the
        # message where the broker has a place for it (a consumer's process span links to it).
        with tracing.send_span(system, transport.name) as traceparent:
            if traceparent is None:
                transport.send(line.encode())
            else:
                transport.send_traced(line.encode(), traceparent)
    transport.close()
    print(f"sent {len(lines)} message(s) to {transport.name}", file=sys.stderr)
    return 0


def _dead_letters(transport: Transport, args: argparse.Namespace) -> int:
    """List the dead letters, or requeue one: 0, 2 for an unknown id, --limit < 1 or a broker
    that cannot do it (named), 3 when the broker drops meanwhile."""
    try:
        if args.requeue:
            new = transport.requeue(args.requeue)
            to = f" as {new}" if new else ""
            print(f"requeued {args.requeue} to {transport.name}{to} (delivery count from 1)")
            return 0
        if args.limit < 1:
            print("pandastack-jobs: --limit: give a number >= 1", file=sys.stderr)
            return 2
        for rec in transport.dead_letters(args.limit):
            if args.json:
                print(json.dumps(rec.as_dict()))
            else:
                field = f" field={rec.field}" if rec.field else ""
                reason = " ".join(rec.reason.split())[:300]
                print(
                    f"broker_id={rec.broker_id} id={rec.id or '-'} kind={rec.kind} "
                    f"deliveries={rec.deliveries}{field} reason={reason}"
                )
        return 0
    except UnknownDeadLetter as exc:
        print(f"pandastack-jobs: --requeue: {exc} (see `dead-letters --broker URL`)", file=sys.stderr)
        return 2
    except DeadLettersUnsupported as exc:
        print(f"pandastack-jobs: dead-letters: {exc}", file=sys.stderr)
        return 2
    except BrokerUnavailable as exc:
        print(f"pandastack-jobs: lost the broker: {exc}", file=sys.stderr)
        return 3
    finally:
        transport.close()


def _check_api(connection: ConnectionConfig) -> int:
    """Say which PandaStack API this worker uses, and check it answers and takes the key: 0, or the
    exit code, after a one-line reason (the key is never printed)."""
    print(f"pandastack-jobs: PandaStack API {describe_api(connection)}", file=sys.stderr)
    try:
        probe(connection)
    except ApiCheckError as exc:
        print(f"pandastack-jobs: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


def _consume(transport: Transport, args: argparse.Namespace) -> int:
    connection = ConnectionConfig()
    failed = _check_api(connection)
    if failed:
        transport.close()
        return failed
    defaults: dict[str, object] = {}
    if args.template:
        defaults["template"] = args.template
    if args.timeout:
        defaults["timeout"] = args.timeout
    try:
        consumer = Consumer(
            transport,
            connection,
            concurrency=args.concurrency,
            max_deliveries=args.max_deliveries,
            defaults=defaults,
            max_message_bytes=args.max_message_bytes,
            release_delay=args.release_delay,
            drain_seconds=args.drain,
            allowed_templates=_allowed(args),
            chunk_size=args.chunk_size,
            chunk_key=args.chunk_key,
            chunk_keyless=args.chunk_keyless,
        )
    except ValueError as exc:
        transport.close()
        print(f"pandastack-jobs: {exc}", file=sys.stderr)
        return 2
    metrics = None
    if args.metrics_port is not None:
        try:
            from .metrics import ConsumerMetrics

            metrics = ConsumerMetrics(consumer)
            port = metrics.serve(args.metrics_port, args.metrics_host)
        except ImportError as exc:
            transport.close()
            print(
                f"pandastack-jobs: --metrics-port: {exc}: pip install 'pandastack-workflows[queue]'",
                file=sys.stderr,
            )
            return 2
        except OSError as exc:
            transport.close()
            print(
                f"pandastack-jobs: --metrics-port: cannot listen on {args.metrics_host}:{args.metrics_port}: "
                f"{exc.strerror or exc}; pick a free port",
                file=sys.stderr,
            )
            return 2
        consumer.observer = metrics
        print(
            f"pandastack-jobs: metrics on http://{args.metrics_host}:{port}/metrics",
            file=sys.stderr,
            flush=True,
        )
    consumer.install_signal_handlers()
    done = threading.Event()
    if not args.quiet:
        tty = sys.stderr.isatty()
        every = args.progress_every or (1.0 if tty else 10.0)

        def progress() -> None:
            while not done.wait(every):
                end = "\r" if tty else "\n"
                sys.stderr.write(f"pandastack-jobs: {consumer.stats.line()}{end}")
                sys.stderr.flush()

        threading.Thread(target=progress, daemon=True, name="progress").start()
    try:
        stats = consumer.run()
    except BrokerUnavailable as exc:
        print(f"\npandastack-jobs: lost the broker while stopping: {exc}", file=sys.stderr)
        return 3
    finally:
        done.set()
        if metrics is not None:
            metrics.close()
    print(f"\npandastack-jobs: stopped: {stats.line()}", file=sys.stderr)
    return 0


def _allowed(args: argparse.Namespace) -> set[str] | None:
    if not args.allowed_templates:
        return None
    return {*args.allowed_templates, *([args.template] if args.template else [])}


if __name__ == "__main__":
    sys.exit(main())
