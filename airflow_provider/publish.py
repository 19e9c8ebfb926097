"""A job's result and collected files → XCom, or object storage when they are too big for XCom.

XCom lives in Airflow's metadata database, so values over ``xcom_max_bytes``
go to an ``ObjectStoragePath`` (one folder per dag / run / task / map index /
try) and XCom carries their path instead.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airflow.sdk import ObjectStoragePath

from pandastack_jobs import JobOutcome

from .attempt import job_key

if TYPE_CHECKING:
    from airflow.sdk import Context

DEFAULT_XCOM_MAX_BYTES = 48 * 1024


@dataclass(frozen=True)
class Publisher:
    """Publishes one try's outcome (built in ``execute``, from rendered fields)."""

    log: Any
    context: Context
    object_storage_path: str | None = None
    object_storage_conn_id: str | None = None
    xcom_max_bytes: int = DEFAULT_XCOM_MAX_BYTES

    def storage_base(self) -> ObjectStoragePath | None:
        """This try's folder in object storage (None without ``object_storage_path``)."""
        if not self.object_storage_path:
            return None
        key = job_key(self.context)
        base = ObjectStoragePath(self.object_storage_path, conn_id=self.object_storage_conn_id)
        parts = [key.workflow, key.run, key.task]
        if key.map_index >= 0:
            parts.append(f"map_{key.map_index}")
        parts.append(f"try_{key.try_number}")
        for part in parts:
            base = base / part.replace("/", "_")
        return base

    def store(self, name: str, data: bytes) -> str | None:
        """Write ``data`` under this try's folder; its URL, or None without object storage."""
        base = self.storage_base()
        if base is None:
            return None
        target = base / name.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        self.log.info("stored %d bytes at %s", len(data), target)
        return str(target)

    def files(self, files: Mapping[str, bytes]) -> dict[str, dict[str, Any]]:
        """``{path: {"size", "text" | "base64" | "path"}}`` for XCom ``files``."""
        published: dict[str, dict[str, Any]] = {}
        for path, data in files.items():
            entry: dict[str, Any] = {"size": len(data)}
            if len(data) > self.xcom_max_bytes:
                uri = self.store(path, data)
                if uri is not None:
                    entry["path"] = uri
                    published[path] = entry
                    continue
                self.log.warning(
                    "PandaStack: %s is %d bytes (over xcom_max_bytes=%d) and no object_storage_path "
                    "is set; pushing it to XCom anyway",
                    path,
                    len(data),
                    self.xcom_max_bytes,
                )
            try:
                entry["text"] = data.decode("utf-8")
            except UnicodeDecodeError:
                entry["base64"] = base64.b64encode(data).decode("ascii")
            published[path] = entry
        return published

    def result(self, outcome: JobOutcome) -> Any:
        """The task's return value: the result, or its stored path when it is over the cap."""
        if not outcome.has_result:
            return None
        raw = json.dumps(outcome.result).encode()
        if len(raw) > self.xcom_max_bytes:
            uri = self.store("result.json", raw)
            if uri is not None:
                self.context["ti"].xcom_push(key="result_path", value=uri)
                self.log.info(
                    "PandaStack: result (%d bytes) is over xcom_max_bytes; XCom holds its path", len(raw)
                )
                return uri
        return outcome.result
