"""The queue demo's stop rule (demo/queue_demo.py): a consumer paused for a PandaStack outage is
waiting, not idle, so the demo never ends its batch with messages still held back uncharged."""

from __future__ import annotations

import time

from demo.queue_demo import IDLE_SECONDS, batch_over
from pandastack_jobs.queue import Stats


def _stats(**kw: object) -> Stats:
    s = Stats()
    for k, v in kw.items():
        setattr(s, k, v)
    return s


def test_every_message_settled_ends_the_batch() -> None:
    over = batch_over(3, time.monotonic() + 60)
    assert not over(_stats(acked=2))
    assert over(_stats(acked=2, dead_lettered=1))


def test_idle_with_nothing_running_ends_it() -> None:
    over = batch_over(3, time.monotonic() + 60)
    assert not over(_stats(last_activity=time.monotonic()))
    assert over(_stats(last_activity=time.monotonic() - IDLE_SECONDS - 1))
    assert not over(_stats(in_flight=1, last_activity=time.monotonic() - IDLE_SECONDS - 1))


def test_a_paused_consumer_is_not_idle_and_its_resume_restarts_the_idle_clock() -> None:
    over = batch_over(3, time.monotonic() + 60)
    stale = time.monotonic() - IDLE_SECONDS - 1
    assert not over(_stats(last_activity=stale, api_down_since=time.time() - 30))
    # PandaStack answers again: the released messages are due back soon, the batch is not over yet.
    assert not over(_stats(last_activity=stale))


def test_the_deadline_ends_it_even_while_paused() -> None:
    over = batch_over(3, time.monotonic() - 1)
    assert over(_stats(api_down_since=time.time()))
