"""Amazon SQS through boto3: visibility timeout as the lease, ``ChangeMessageVisibility`` to extend
it or to delay a redelivery, ``DeleteMessage`` as the ack, a DLQ with a redrive policy.

A message's identity is the ``MessageId`` SQS gave its send (a release only changes its
visibility, so it keeps it); the delivery count is ``ApproximateReceiveCount``. Message
attributes are the producer's and are never read. The redrive policy's
``maxReceiveCount`` is a backstop for a message that kills every consumer
before it can be dead-lettered with a reason; the consumer dead-letters first
(with the reason) when the policy is ``max_deliveries + 1``. Tested against
moto's server, not against AWS.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any
from urllib.parse import parse_qs, urlsplit

import boto3
import botocore.config
import botocore.exceptions

from .transport import (
    BrokerUnavailable,
    DeadLetter,
    DeadLetterRecord,
    Delivery,
    LeaseLost,
    RecordRejected,
    Transport,
)

logger = logging.getLogger(__name__)

_ERRORS = (
    botocore.exceptions.EndpointConnectionError,
    botocore.exceptions.ConnectionClosedError,
    botocore.exceptions.ReadTimeoutError,
    botocore.exceptions.ConnectTimeoutError,
)

# A receipt handle that is stale (the visibility timeout ran out and someone else received it).
_LOST_CODES = frozenset({"ReceiptHandleIsInvalid", "InvalidParameterValue", "MessageNotInflight"})


class SQSTransport(Transport):
    """``sqs://QUEUE?region=eu-west-1&endpoint_url=http://127.0.0.1:4566&redrive_after=6``.

    Creates ``QUEUE``, ``QUEUE-dead`` and ``QUEUE-results`` when missing.
    """

    def __init__(self, url: str, lease_seconds: float = 60.0) -> None:
        parts = urlsplit(url)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        self.name = parts.netloc or parts.path.strip("/") or "pandastack-jobs"
        self.lease_seconds = lease_seconds
        self._endpoint = query.get("endpoint_url")
        self._region = query.get("region", "us-east-1")
        self._redrive_after = int(query.get("redrive_after", "10"))
        self._client: Any = None
        self.urls: dict[str, str] = {}

    def connect(self) -> None:
        config = botocore.config.Config(connect_timeout=10, read_timeout=25, retries={"max_attempts": 2})
        client = boto3.client("sqs", region_name=self._region, endpoint_url=self._endpoint, config=config)
        try:
            dead = self._ensure(client, f"{self.name}-dead", {})
            arn = client.get_queue_attributes(QueueUrl=dead, AttributeNames=["QueueArn"])["Attributes"][
                "QueueArn"
            ]
            policy = {"deadLetterTargetArn": arn, "maxReceiveCount": str(self._redrive_after)}
            attrs = {
                "VisibilityTimeout": str(math.ceil(self.lease_seconds or 30)),
                "RedrivePolicy": json.dumps(policy),
            }
            self.urls = {
                "queue": self._ensure(client, self.name, attrs),
                "dead": dead,
                "results": self._ensure(client, f"{self.name}-results", {}),
            }
        except (*_ERRORS, botocore.exceptions.NoCredentialsError) as exc:
            raise BrokerUnavailable(f"SQS at {self._endpoint or self._region}: {exc}") from None
        self._client = client

    @staticmethod
    def _ensure(client: Any, name: str, attrs: dict[str, str]) -> str:
        try:
            return str(client.get_queue_url(QueueName=name)["QueueUrl"])
        except client.exceptions.QueueDoesNotExist:
            return str(client.create_queue(QueueName=name, Attributes=attrs)["QueueUrl"])

    def _call(self, op: str, **kwargs: Any) -> Any:
        if self._client is None:
            raise BrokerUnavailable("SQS: not connected")
        try:
            return getattr(self._client, op)(**kwargs)
        except _ERRORS as exc:
            raise BrokerUnavailable(f"SQS at {self._endpoint or self._region}: {exc}") from None
        except botocore.exceptions.ClientError as exc:
            # Only a call with a receipt handle has a lease to lose (a send's InvalidParameterValue
            # is about the message: ``reply``).
            if "ReceiptHandle" in kwargs and exc.response.get("Error", {}).get("Code") in _LOST_CODES:
                raise LeaseLost(f"SQS {op}: {exc}") from None
            raise

    def receive(self, max_messages: int, wait_seconds: float) -> list[Delivery]:
        started = time.monotonic()
        got = self._call(
            "receive_message",
            QueueUrl=self.urls["queue"],
            MaxNumberOfMessages=max(1, min(max_messages, 10)),
            WaitTimeSeconds=min(20, int(wait_seconds)) if wait_seconds >= 1 else 0,
            VisibilityTimeout=math.ceil(self.lease_seconds or 30),
            AttributeNames=["ApproximateReceiveCount", "SentTimestamp"],
            MessageAttributeNames=["traceparent"],
        )
        out = [d for d in (_delivery(m) for m in got.get("Messages", [])) if d is not None]
        if not out and wait_seconds < 1:
            time.sleep(max(0.0, wait_seconds - (time.monotonic() - started)))
        return out

    def ack(self, delivery: Delivery) -> None:
        self._call("delete_message", QueueUrl=self.urls["queue"], ReceiptHandle=delivery.handle)

    def release(self, delivery: Delivery, delay_seconds: float) -> None:
        self._call(
            "change_message_visibility",
            QueueUrl=self.urls["queue"],
            ReceiptHandle=delivery.handle,
            VisibilityTimeout=min(43200, math.ceil(delay_seconds)),
        )

    def dead_letter(self, delivery: Delivery, why: DeadLetter) -> None:
        attrs = {
            "reason": {"DataType": "String", "StringValue": why.reason or "-"},
            "kind": {"DataType": "String", "StringValue": why.kind},
            "message_id": {"DataType": "String", "StringValue": delivery.message_id},
            "why": {"DataType": "String", "StringValue": why.to_json()},
        }
        body = delivery.body.decode("utf-8", "replace") or "-"
        self._call("send_message", QueueUrl=self.urls["dead"], MessageBody=body, MessageAttributes=attrs)
        self.ack(delivery)

    def _peek_dead(self, limit: int) -> list[tuple[dict[str, Any], DeadLetterRecord]]:
        """Receive up to ``limit`` dead letters (each hidden for a minute meanwhile): SQS has no
        browse; the caller makes them visible again (:meth:`_unhide`) or deletes them."""
        got: list[tuple[dict[str, Any], DeadLetterRecord]] = []
        seen: set[str] = set()
        while len(got) < limit:
            page = self._call(
                "receive_message",
                QueueUrl=self.urls["dead"],
                MaxNumberOfMessages=max(1, min(limit - len(got), 10)),
                VisibilityTimeout=60,
                AttributeNames=["SentTimestamp"],
                MessageAttributeNames=["message_id", "why"],
            ).get("Messages", [])
            fresh = [m for m in page if m["MessageId"] not in seen]
            if not fresh:
                break
            for m in fresh:
                seen.add(m["MessageId"])
                attrs = m.get("MessageAttributes", {})
                why = attrs.get("why", {}).get("StringValue")
                mid = attrs.get("message_id", {}).get("StringValue") or m["MessageId"]
                sent = m.get("Attributes", {}).get("SentTimestamp")
                at = int(sent) / 1000 if sent else None
                body = str(m["Body"]).encode()
                got.append((m, DeadLetterRecord.stored(mid, body, why, at)))
        return got

    def _unhide(self, messages: list[dict[str, Any]]) -> None:
        for m in messages:
            self._call(
                "change_message_visibility",
                QueueUrl=self.urls["dead"],
                ReceiptHandle=m["ReceiptHandle"],
                VisibilityTimeout=0,
            )

    def dead_letters(self, limit: int = 100) -> list[DeadLetterRecord]:
        """Received from ``QUEUE-dead`` and made visible again at once."""
        got = self._peek_dead(limit)
        self._unhide([m for m, _ in got])
        return [rec for _, rec in got]

    def _put_back(self, broker_id: str) -> str | None:
        """``SendMessage`` of the body to ``QUEUE`` (a new ``MessageId``, delivery 1), then the dead
        letter is deleted: SQS cannot mark it, so its reason is logged as the message's history."""
        got = self._peek_dead(10_000)
        try:
            found = next(((m, rec) for m, rec in got if rec.broker_id == broker_id), None)
            if found is None:
                return None
            m, rec = found
            sent = self._call("send_message", QueueUrl=self.urls["queue"], MessageBody=m["Body"])
            self._call("delete_message", QueueUrl=self.urls["dead"], ReceiptHandle=m["ReceiptHandle"])
            new = str(sent.get("MessageId") or "")
            logger.warning(
                "requeued: id=%s broker_id=%s as %s; it was dead-lettered kind=%s deliveries=%d reason=%s",
                rec.id or "-",
                broker_id,
                new,
                rec.kind,
                rec.deliveries,
                " ".join(rec.reason.split())[:500],
            )
            return new
        finally:
            self._unhide([m for m, rec in got if rec.broker_id != broker_id])

    def extend(self, delivery: Delivery) -> None:
        self.release(delivery, self.lease_seconds or 30)

    def reply(self, body: bytes) -> None:
        """SendMessage to ``QUEUE-results``; a result over the queue's ``MaximumMessageSize`` is
        :class:`RecordRejected` (the same result is refused again: no redelivery)."""
        try:
            self._call("send_message", QueueUrl=self.urls["results"], MessageBody=body.decode())
        except botocore.exceptions.ClientError as exc:
            error = exc.response.get("Error", {})
            text = str(error.get("Message", ""))
            if "InvalidParameterValue" not in str(error.get("Code", "")) or "shorter than" not in text:
                raise
            raise RecordRejected(
                f"SQS: {self.name}-results refused a result of {len(body)} bytes ({text}); raise the"
                " queue's MaximumMessageSize (at most 1 MiB) or make the result smaller",
                size=len(body),
            ) from None

    def send(self, body: bytes, message_id: str | None = None) -> None:
        """SendMessage (``message_id`` has no place: SQS gives the message its ``MessageId``)."""
        self._call("send_message", QueueUrl=self.urls["queue"], MessageBody=body.decode("utf-8", "replace"))

    def send_traced(self, body: bytes, traceparent: str | None) -> None:
        """A message with a ``traceparent`` message attribute."""
        attrs = {"traceparent": {"DataType": "String", "StringValue": traceparent}} if traceparent else {}
        self._call(
            "send_message",
            QueueUrl=self.urls["queue"],
            MessageBody=body.decode("utf-8", "replace"),
            MessageAttributes=attrs,
        )

    def backlog(self) -> dict[str, int] | None:
        """SQS's approximate counts, one GetQueueAttributes call."""
        names = {
            "ApproximateNumberOfMessages": "ready",
            "ApproximateNumberOfMessagesNotVisible": "leased",
            "ApproximateNumberOfMessagesDelayed": "delayed",
        }
        got = self._call("get_queue_attributes", QueueUrl=self.urls["queue"], AttributeNames=list(names))
        attrs = got.get("Attributes", {})
        return {state: int(attrs.get(name, 0)) for name, state in names.items()}


def _delivery(m: dict[str, Any]) -> Delivery | None:
    """One received message as a delivery (never raises: a message SQS returned without what a
    delivery needs is logged and left to its visibility timeout and the redrive policy)."""
    try:
        count = int(m.get("Attributes", {}).get("ApproximateReceiveCount", 1))
        # Producer-written (the metrics and traces validate them): when it was sent, its trace.
        extra = {
            "sent": m.get("Attributes", {}).get("SentTimestamp"),
            "traceparent": m.get("MessageAttributes", {}).get("traceparent", {}).get("StringValue"),
        }
        return Delivery(
            str(m["MessageId"]),
            str(m["Body"]).encode(),
            max(count, 1),
            handle=m["ReceiptHandle"],
            extra=extra,
        )
    except Exception as exc:  # noqa: BLE001 - confined to this message
        logger.warning(
            "SQS message %s could not be read (%s); left to the redrive policy", m.get("MessageId"), exc
        )
        return None
