"""Queue worker: drain a batch of messages from a broker, each message's sandbox job a task run.

Each message (docs/queues.md, ``pandastack-job/1``) runs in its own throwaway
sandbox as a ``queue-message`` task run of this flow; it stays leased on the
broker until the task run completed with the result on the reply destination,
then it is acked. A failed task run's message goes back to the broker for
redelivery, or to its dead-letter destination with the reason. Set
``PANDASTACK_QUEUE_BROKER``; serve it on a schedule with
``consume_queue.serve(name="queue-worker", cron="*/5 * * * *", parameters=...)``.
"""

from __future__ import annotations

import os

from prefect_blocks.queue import consume_queue

BROKER = os.environ.get("PANDASTACK_QUEUE_BROKER", "redis://127.0.0.1:6379/0?stream=pandastack-jobs")


def queue_worker() -> dict[str, int]:
    return consume_queue(
        broker=BROKER,
        concurrency=4,
        max_messages=200,
        idle_seconds=10,
        defaults={"template": "code-interpreter", "timeout": 120},
    )


if __name__ == "__main__":
    print(queue_worker())
