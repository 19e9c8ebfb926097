"""A stand-in for what an operator reads and writes of its task try (no metadata DB)."""

from __future__ import annotations

from typing import Any


class TI:
    """What the operator reads and writes of its task instance."""

    def __init__(self, try_number: int = 1, map_index: int = -1) -> None:
        self.dag_id, self.task_id, self.run_id = "d", "t", "manual__1"
        self.try_number, self.map_index = try_number, map_index
        self.xcom: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcom[key] = value


class Store(dict):  # type: ignore[type-arg]
    """``task_state_store``: get / set / delete."""

    def set(self, key: str, value: Any) -> None:
        self[key] = value

    def delete(self, key: str) -> None:
        self.pop(key, None)


def context(ti: TI | None = None, store: Store | None = None) -> dict[str, Any]:
    return {"ti": ti or TI(), "task_state_store": Store() if store is None else store}
