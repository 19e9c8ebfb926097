"""Classification defaults (pandastack_jobs/classify.py: dead-letter what retrying cannot fix,
redeliver the rest) and their configuration."""

from __future__ import annotations

import pytest

from pandastack_jobs import Classifier, FailureClass, FailureKind

REDELIVER = FailureClass.REDELIVER
DEAD = FailureClass.DEAD_LETTER


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (FailureKind.EXIT_CODE, REDELIVER),
        (FailureKind.TIMEOUT, REDELIVER),
        (FailureKind.SANDBOX_LOST, REDELIVER),
        (FailureKind.CONNECTION, REDELIVER),
        (FailureKind.SERVER_ERROR, REDELIVER),
        (FailureKind.CAPACITY, REDELIVER),
        (FailureKind.PERMANENT_EXIT_CODE, DEAD),
        (FailureKind.RESULT_MISSING, DEAD),
        (FailureKind.RESULT_INVALID, DEAD),
        (FailureKind.RESULT_TOO_LARGE, DEAD),
        (FailureKind.AUTH, DEAD),
        (FailureKind.BAD_REQUEST, DEAD),
        (FailureKind.UNKNOWN_TEMPLATE, DEAD),
        (FailureKind.CANCELLED, DEAD),
    ],
)
def test_default_table(kind: FailureKind, expected: FailureClass) -> None:
    assert Classifier().classify(kind) is expected


def test_permanent_exit_codes_and_timeout_policy() -> None:
    c = Classifier(permanent_exit_codes=frozenset({3}), retry_on_timeout=False)
    assert c.kind_for_exit(3) is FailureKind.PERMANENT_EXIT_CODE
    assert c.kind_for_exit(1) is FailureKind.EXIT_CODE
    assert c.classify(FailureKind.TIMEOUT) is DEAD


def test_custom_rule_decides_first_and_can_defer() -> None:
    def rule(kind: FailureKind, exit_code: int | None) -> FailureClass | None:
        return DEAD if exit_code == 137 else None

    c = Classifier(custom=rule)
    assert c.classify(FailureKind.EXIT_CODE, 137) is DEAD
    assert c.classify(FailureKind.EXIT_CODE, 1) is REDELIVER
