"""The signed bookkeeping stamps (pandastack_jobs/queue/stamps.py) that RabbitMQ's work queue and
Kafka's retry topic carry: one helper, the same bytes RabbitMQ always signed."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from pandastack_jobs.queue.stamps import MAX_PRIOR, Stamper


def test_a_stamp_without_more_fields_is_the_one_rabbitmq_always_signed() -> None:
    """Messages already in a work queue, signed before the helper, still verify."""
    key = hmac.new(b"s3cret", b"pandastack-queue-stamp\x1fjobs", "sha256").digest()
    old = hmac.new(key, b"m1\x1f2\x1f" + hashlib.sha256(b"body").digest(), "sha256").hexdigest()
    stamps = Stamper("jobs", "s3cret")
    assert stamps.sign("m1", 2, b"body") == old and stamps.verify(old, "m1", 2, b"body")


def test_every_signed_field_counts_and_the_key_is_per_queue_and_secret() -> None:
    stamps = Stamper("jobs", "s3cret")
    sig = stamps.sign("0-1", 3, b"body", "1700000000.000")
    assert stamps.verify(sig, "0-1", 3, b"body", "1700000000.000")
    assert stamps.verify(sig.encode(), "0-1", 3, b"body", "1700000000.000")
    for args in (
        ("0-2", 3, b"body", "1700000000.000"),
        ("0-1", 4, b"body", "1700000000.000"),
        ("0-1", 3, b"other", "1700000000.000"),
        ("0-1", 3, b"body", "1800000000.000"),
        ("0-1", 3, b"body"),
    ):
        assert not stamps.verify(sig, *args), args
    assert not Stamper("other", "s3cret").verify(sig, "0-1", 3, b"body", "1700000000.000")
    assert not Stamper("jobs", "another").verify(sig, "0-1", 3, b"body", "1700000000.000")


@pytest.mark.parametrize(
    ("sig", "mid", "prior"),
    [
        (None, "m", 1),
        ("x", None, 1),
        ("x", "", 1),
        ("x", "m", "1"),
        ("x", "m", True),
        ("x", "m", -1),
        ("x", "m", MAX_PRIOR),
        (12, "m", 1),
        ("\udcff", "m", 1),
    ],
)
def test_what_a_producer_writes_never_verifies_and_never_raises(
    sig: object, mid: object, prior: object
) -> None:
    assert not Stamper("jobs", "s3cret").verify(sig, mid, prior, b"body")


def test_without_a_secret_stamps_still_sign_but_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PANDASTACK_QUEUE_SECRET", raising=False)
    monkeypatch.delenv("PANDASTACK_API_KEY", raising=False)
    assert not Stamper("jobs").signed
    monkeypatch.setenv("PANDASTACK_API_KEY", "pds_" + "1" * 32)
    assert Stamper("jobs").signed
    assert Stamper("jobs").sign("m", 1, b"") == Stamper("jobs", "pds_" + "1" * 32).sign("m", 1, b"")
