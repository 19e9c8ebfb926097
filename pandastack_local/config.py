"""Server settings, shared by the CLI, the app and LocalServer."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

API_KEY_ENV = "PANDASTACK_LOCAL_API_KEY"
# Admission is by real use (admission.py): an idle sandbox costs ~8 MB, so the count is the cap.
DEFAULT_MAX_SANDBOXES = 1000
DEFAULT_POOL_SIZE = 2
# Not 8080 (Airflow's api-server), 8793/8794 (its log servers), 4200 (Prefect), 5555 (Flower),
# 8888 (Jupyter), 8787 (Dask), 5000 (MLflow): a newcomer runs this next to them.
DEFAULT_PORT = 8321
MIN_MEMORY_HEADROOM_MB = 1024
DEFAULT_STREAM_BUFFER_MB = 256  # 256 exec/streams at limits.STREAM_HOLD_BYTES each


def default_memory_budget_mb() -> int | None:
    """Host memory minus headroom for the host itself (an eighth, at least 1 GiB): what the live
    sandboxes may use (``usage`` admission) or claim by their limits (``limits``) in all."""
    try:
        with open("/proc/meminfo") as f:
            total = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:")) // 1024
    except (OSError, StopIteration, ValueError):
        return None
    return max(total - max(MIN_MEMORY_HEADROOM_MB, total // 8), 256)


def port_taken(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on, with the fix, or None when it is free."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            return (
                f"pandastack-local: cannot listen on {host}:{port}: {exc.strerror or exc}. "
                "Another program (Airflow's api-server uses 8080, Prefect 4200) or another "
                f"pandastack-local holds it: stop it, or pick a free port with --port "
                f"(the default is {DEFAULT_PORT})."
            )
    return None


def generate_api_key() -> str:
    """A key shaped like the platform's: ``pds_`` + 32 hex chars."""
    return "pds_" + secrets.token_hex(16)


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "pandastack-local"


@dataclass
class ServerConfig:
    api_key: str
    state_dir: Path = field(default_factory=default_state_dir)
    max_sandboxes: int | None = DEFAULT_MAX_SANDBOXES
    # None: no budget. The CLI's default is default_memory_budget_mb().
    memory_budget_mb: int | None = None
    # "usage": admit by what sandboxes use (the memory guard keeps the host safe); "limits": by
    # the sum of their memory limits (no overcommit).
    admission: str = "usage"
    ttl_scan_interval: float = 30.0
    template_dirs: tuple[str, ...] = ()
    # Pre-started, limited, never-reused sandboxes kept per template (0 disables).
    pool_size: int = DEFAULT_POOL_SIZE
    # HOST:PORT endpoints reachable from inside every sandbox (isolation/egress.py); nothing else is.
    allow_egress: tuple[str, ...] = ()
    # Built template environments (None: ~/.cache/pandastack-local), shared across servers.
    cache_dir: Path | None = None
    # The boundary around each sandbox: "bwrap" (default) or "gvisor" (isolation/backend.py).
    isolation: str = "bwrap"
    # gVisor's runsc (None: runsc on PATH).
    runsc: str | None = None
    # Memory the server may hold for slow readers (exec/stream, GET fs) and uploads (PUT fs), all
    # transfers together (limits.StreamBudget).
    stream_buffer_mb: int = DEFAULT_STREAM_BUFFER_MB
    # GET /metrics without the API key (a trusted network's scraper); by default it takes the key.
    metrics_without_key: bool = False
