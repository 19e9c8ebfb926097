"""Import paths that moved between Airflow 3.1 and 3.3, resolved once.

The Task SDK's exception classes moved to ``airflow.sdk.exceptions`` in 3.2/3.3; the task runner
of each version catches its own, so the newest path that exists is the right one. AIP-105 retry
policies (``retry_policy=``) exist from 3.3 only; before that the exception class alone decides
(dead-letter: ``AirflowFailException``, never retried; redeliver: retried), and a capacity
``Retry-After`` is not turned into the retry delay.
"""

from __future__ import annotations

from typing import Any

try:
    from airflow.sdk.exceptions import AirflowException, AirflowFailException
except ImportError:  # Airflow < 3.2
    from airflow.exceptions import AirflowException, AirflowFailException  # type: ignore[no-redef]

try:
    from airflow.sdk.exceptions import AirflowNotFoundException
except ImportError:  # Airflow < 3.3
    from airflow.exceptions import AirflowNotFoundException  # type: ignore[no-redef]

try:
    from airflow.sdk.definitions.retry_policy import RetryDecision, RetryPolicy

    HAS_RETRY_POLICY = True
except ImportError:  # Airflow < 3.3: no retry_policy argument
    HAS_RETRY_POLICY = False
    RetryPolicy = object  # type: ignore[assignment,misc]
    RetryDecision: Any = None  # type: ignore[no-redef]

__all__ = [
    "HAS_RETRY_POLICY",
    "AirflowException",
    "AirflowFailException",
    "AirflowNotFoundException",
    "RetryDecision",
    "RetryPolicy",
]
