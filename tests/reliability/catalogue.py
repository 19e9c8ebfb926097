"""The hostile-job catalogue: the hostile template, the hostile jobs and what the project
documents for each, the well-behaved sibling and the escape probe.

The guest programs are files (``hostile/*.py``, and ``sample_jobs/tenants/evil_*.py`` for the two the
examples share), read at run time and sent into the sandbox as ``job.py``. Engine-neutral:
imported by the core, Airflow and Prefect files alike.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pandastack_jobs import FailureClass, FailureKind
from tests.support.server import GVISOR, write_template

HOSTILE_DIR = Path(__file__).resolve().parent / "hostile"
TENANTS = Path(__file__).resolve().parents[2] / "sample_jobs" / "tenants"

# The orchestrator's own secret: set in the test process (and so in the server's environment).
CANARY_NAME = "PS_RELIABILITY_ORCHESTRATOR_SECRET"
CANARY_VALUE = "orchestrator-canary-7d41e0b2"
# A token-shaped string the sibling prints (hostile/sibling.py): the Redactor must mask it everywhere.
FAKE_TOKEN = "pds_" + "feedfacecafebeef" * 2

TEMPLATE = "hostile"
TEMPLATE_SPEC = {"name": TEMPLATE, "cpu": 1, "memory_mb": 256, "pids_max": 64, "disk_mb": 128, "nofile": 128}
TEMPLATE_FILE = "/opt/app/hello.txt"  # hostile/sibling.py reads it
TEMPLATE_FILE_TEXT = "pristine template file\n"


def guest(name: str) -> str:
    """The source of guest program ``hostile/<name>.py``."""
    return (HOSTILE_DIR / f"{name}.py").read_text()


def write_hostile_template(base: Path) -> Path:
    """``base/hostile``: 1 CPU, 256 MB, 64 pids, 128 MB disk, 128 open files, one template file."""
    write_template(base / TEMPLATE, {TEMPLATE_FILE: TEMPLATE_FILE_TEXT}, **TEMPLATE_SPEC)
    return base


# -- the well-behaved sibling and the escape probe -----------------------------------------------

SIBLING_JOB = guest("sibling")
SIBLING_WITH_SECRET = guest("sibling_with_secret")
ESCAPE_PROBE = guest("escape_probe")


def sibling_rows(i: int) -> list[int]:
    return list(range(i, i + 50))


def sibling_expected(i: int) -> dict[str, Any]:
    rows = sibling_rows(i)
    return {"n": len(rows), "sum_sq": sum(r * r for r in rows), "hello": TEMPLATE_FILE_TEXT}


# -- the hostile jobs ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Hostile:
    """One hostile case: what it tries, the outcome and class the project documents for it."""

    name: str
    tries: str
    code: str
    kind: FailureKind
    guarantee: str
    timeout: float = 30.0
    # Files sent beside job.py (e.g. fill.py's fill_target).
    files: dict[str, str] = field(default_factory=dict)
    # A line the job prints before the wall stops it; its number must stay under ``wall``.
    counter: str | None = None
    wall: int | None = None
    stderr_has: str | None = None
    # The kind under gVisor where it differs (docs/local-server.md): the class must not differ.
    gvisor_kind: FailureKind | None = None

    @property
    def expected_kind(self) -> FailureKind:
        """The kind this backend (PANDASTACK_LOCAL_ISOLATION) gives the case."""
        return self.gvisor_kind if GVISOR and self.gvisor_kind is not None else self.kind

    @property
    def failure_class(self) -> FailureClass:
        return class_of(self.expected_kind)


def class_of(kind: FailureKind) -> FailureClass:
    """The class the core gives a kind (redeliver unless the job itself is at fault for good)."""
    if kind in (
        FailureKind.PERMANENT_EXIT_CODE,
        FailureKind.RESULT_MISSING,
        FailureKind.RESULT_INVALID,
        FailureKind.RESULT_TOO_LARGE,
    ):
        return FailureClass.DEAD_LETTER
    return FailureClass.REDELIVER


def decompression_bomb_file() -> bytes:
    """64 MiB of zeros, compressed to about 64 KiB (made here: no binary file in the repo)."""
    return zlib.compress(b"\0" * (64 << 20), 9)


HOSTILE_CASES = [
    Hostile(
        "memory_hog",
        "allocate 64 MiB blocks forever (past the template's 256 MB)",
        (TENANTS / "evil_memory_hog.py").read_text(),
        FailureKind.EXIT_CODE,
        "OOM-killed inside its own cgroup: exit 137, redeliver",
        gvisor_kind=FailureKind.SANDBOX_LOST,
    ),
    Hostile(
        "decompression_bomb",
        "inflate a 64 KiB zlib bomb 100 times in memory (6.4 GiB)",
        guest("decompression_bomb"),
        FailureKind.EXIT_CODE,
        "OOM-killed inside its own cgroup: exit 137, redeliver",
    ),
    Hostile(
        "fork_bomb",
        "fork forever, ignoring EAGAIN",
        (TENANTS / "evil_fork_bomb.py").read_text(),
        FailureKind.TIMEOUT,
        "pids.max (64) stops it; the guest clock kills the whole group: timeout, redeliver",
        timeout=4,
        gvisor_kind=FailureKind.SANDBOX_LOST,
    ),
    Hostile(
        "threads",
        "start 5,000 threads",
        guest("threads"),
        FailureKind.EXIT_CODE,
        "pids.max (64) stops it at < 64 threads: the job fails, redeliver",
        counter="threads started:",
        wall=64,
        stderr_has="can't start new thread",
    ),
    Hostile(
        "hot_loop",
        "spin a CPU hot loop past its timeout",
        guest("hot_loop"),
        FailureKind.TIMEOUT,
        "killed at its timeout (guest clock): timeout, redeliver; CPU quota 1 core",
        timeout=3,
    ),
    Hostile(
        "exponential_regex",
        "match (a+)+$ against 64 a's and a b (catastrophic backtracking)",
        guest("exponential_regex"),
        FailureKind.TIMEOUT,
        "killed at its timeout: timeout, redeliver",
        timeout=3,
    ),
    *(
        Hostile(
            f"fill_{where}",
            f"write a 4 GiB file to /{where}",
            guest("fill"),
            FailureKind.EXIT_CODE,
            "the 128 MB tmpfs cap stops it (ENOSPC): the job fails, redeliver",
            files={"fill_target": f"/{where}/fill.bin"},
            counter="MiB written:",
            wall=129,
            stderr_has="No space left on device",
        )
        for where in ("tmp", "work")
    ),
    Hostile(
        "open_files",
        "open files until something stops it",
        guest("open_files"),
        FailureKind.EXIT_CODE,
        "RLIMIT_NOFILE (128) stops it (EMFILE): the job fails, redeliver",
        counter="files opened:",
        wall=128,
        stderr_has="Too many open files",
    ),
    Hostile(
        "open_sockets",
        "open TCP sockets and socket pairs until something stops it",
        guest("open_sockets"),
        FailureKind.EXIT_CODE,
        "RLIMIT_NOFILE (128) stops it (EMFILE): the job fails, redeliver",
        counter="sockets opened:",
        wall=128,
        stderr_has="Too many open files",
    ),
    Hostile(
        "result_bomb",
        "exit 0 with a 24 MiB result.json (past the 16 MiB cap)",
        guest("result_bomb"),
        FailureKind.RESULT_TOO_LARGE,
        "the size is checked before reading: result_too_large, dead-letter; the orchestrator never loads it",
    ),
    Hostile(
        "kill_everything",
        "kill(-1, SIGKILL): every process it can see",
        guest("kill_everything"),
        FailureKind.EXIT_CODE,
        "only its own sandbox's processes die, but not the agent (the sandbox's PID 1 under both "
        "backends): the job ends with an exit code, redeliver; host untouched",
    ),
]
HOSTILE = {case.name: case for case in HOSTILE_CASES}
# Under gVisor a job that exhausts its sandbox's memory loses the sentry (sandbox_lost) instead of
# being OOM-killed alone (exit 137): the kind differs, the class (redeliver or dead-letter) must not.
assert all(class_of(c.kind) is class_of(c.gvisor_kind) for c in HOSTILE_CASES if c.gvisor_kind)


def hostile_files(case: Hostile) -> dict[str, bytes | str]:
    """What the job's sandbox gets: ``job.py`` and the case's files."""
    files: dict[str, bytes | str] = {"job.py": case.code, **case.files}
    if case.name == "decompression_bomb":
        files["bomb.z"] = decompression_bomb_file()
    return files


def counted(text: str, prefix: str) -> int | None:
    """The number after ``prefix`` on the first line that starts with it (a ``counter`` line)."""
    for line in text.splitlines():
        if line.startswith(prefix):
            return int(line.split(prefix, 1)[1].split()[0])
    return None
