"""(issue 15) bwrap beside gVisor, in one run: what the guest-kernel boundary costs here.

Run: ``python -m benchmarks.gvisor [--n N]``. For each backend, its own pandastack-local:
create from the warm pool, a cold create (pool off; under gVisor a restore of the template's
boot image), the Python JSON job through ``run_job`` (with the pool refilled between jobs, and
back to back, where the pool runs dry), the job's own interpreter start (``python3 -c 'import
json'`` through exec), fork (bwrap: a cold sandbox + the parent's disk copied; gVisor:
checkpoint + restore, memory copied), the memory one idle sandbox holds (its memory cgroup's
usage) and the CPU one JSON job costs (its sandbox's processes' CPU time while the job runs).
Then runsc's own floor here, with nothing inside: ``runsc run``, ``checkpoint`` and ``restore``
of an empty container, in the same run. The targets (issue 27, item 4) are relative to that
floor: cold create <= restore + 50 ms, JSON job <= its interpreter + 60 ms, fork <= checkpoint +
restore + 60 ms. Also: how long DELETE takes to answer and how long the host removal behind
it goes on (``/healthz`` ``tearing_down``), and where a JSON job's time goes (its outcome's
step timings), so a missed target says what bounds it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import JOB_CODE, JOB_INPUT, interleaved, log, machine, summary, timed, write_json
from benchmarks.options import int_options
from benchmarks.overhead import core_job

BACKENDS = ("bwrap", "gvisor")
POOL_REFILL_WAIT_S = 30.0


def tree_mib(path: Path) -> float:
    """Size of the files under ``path`` in MiB (a checkpoint image's memory and state)."""
    total = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0
    return round(total / 2**20, 1)


def cgroup_file(sandbox_id: str, name: str) -> Path | None:
    """A v1 cgroup file of the sandbox (memory.usage_in_bytes, cgroup.procs), if there is one.
    Other servers add and remove cgroups during the walk: a vanished directory is skipped."""
    for base in Path("/sys/fs/cgroup").iterdir():
        for parent, dirs, _ in os.walk(base, onerror=lambda _exc: None):
            if sandbox_id in dirs and (Path(parent) / sandbox_id / name).exists():
                return Path(parent) / sandbox_id / name
    return None


def pool_creates(server: Any, n: int) -> list[float]:
    """Each create taken from a full pool: wait until the pool hands over before timing the next."""
    client = server.client()
    samples: list[float] = []
    deadline = time.monotonic() + POOL_REFILL_WAIT_S * n
    while len(samples) < n and time.monotonic() < deadline:
        started = time.perf_counter()
        sb = client.sandboxes.create()
        took = time.perf_counter() - started
        if sb.boot_mode == "pool":
            samples.append(took)
        sb.kill()
        time.sleep(1.0)  # let the pool refill (a gVisor start is ~0.5 s on two busy cores)
    return samples


def forks(client: Any, n: int) -> list[float]:
    parent = client.sandboxes.create()
    try:
        parent.exec("python3 -c 'import json' && echo warm > /work/state")
        samples = []
        for _ in range(n):
            started = time.perf_counter()
            (child,) = client.sandboxes.fork_tree(parent.id, 1)
            samples.append(time.perf_counter() - started)
            child.kill()
        return samples
    finally:
        parent.kill()


def idle_memory_mib(client: Any, count: int = 3) -> float:
    sandboxes = [client.sandboxes.create() for _ in range(count)]
    try:
        time.sleep(1.0)
        used = []
        for sb in sandboxes:
            path = cgroup_file(sb.id, "memory.usage_in_bytes")
            if path is not None:
                used.append(int(path.read_text()) / 2**20)
        return round(sum(used) / len(used), 1) if used else float("nan")
    finally:
        for sb in sandboxes:
            sb.kill()


def cgroup_cpu_ms(procs: Path) -> float:
    """CPU time (user + system, with reaped children) of every process in the cgroup: bwrap's
    agent (its execs are reaped children) or gVisor's runsc, sentry, gofer and stubs."""
    ticks = 0
    for pid in procs.read_text().split():
        try:
            data = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = data[data.rfind(")") + 2 :].split()
        ticks += sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
    return ticks * 1000 / os.sysconf("SC_CLK_TCK")


def job_cpu_ms(client: Any, n: int) -> float:
    """CPU time one JSON job costs its sandbox (write the files, run, read the result)."""
    samples = []
    for _ in range(n):
        sb = client.sandboxes.create()
        try:
            procs = cgroup_file(sb.id, "cgroup.procs")
            if procs is None:
                return float("nan")
            before = cgroup_cpu_ms(procs)
            sb.filesystem.write("/work/run.py", JOB_CODE)
            sb.filesystem.write("/work/input.json", json.dumps(JOB_INPUT))
            assert sb.exec("cd /work && python3 run.py").exit_code == 0
            sb.filesystem.read("/work/result.json")
            samples.append(cgroup_cpu_ms(procs) - before)
        finally:
            sb.kill()
    samples.sort()
    return round(samples[len(samples) // 2], 1)


def pooled_jobs(client: Any, n: int) -> tuple[list[float], dict[str, list[float]]]:
    """The JSON job with a sandbox waiting in the pool: the job's own latency, not the pool's
    refill rate (the back-to-back figure shows that); and each of its steps' seconds."""
    from pandastack_jobs import JobSpec, run_job

    spec = JobSpec(command="python3 run.py", files={"run.py": JOB_CODE}, input=JOB_INPUT, timeout=60)
    samples: list[float] = []
    steps: dict[str, list[float]] = {k: [] for k in ("create", "deliver", "exec", "collect", "delete")}
    for _ in range(n):
        time.sleep(1.0)  # let the pool refill (untimed)
        started = time.perf_counter()
        outcome = run_job(client, spec)
        samples.append(time.perf_counter() - started)
        assert outcome.ok, outcome.reason
        for k, values in steps.items():
            values.append(getattr(outcome.timings, k))
    return samples, steps


def deletes(server: Any, n: int) -> dict[str, Any]:
    """DELETE's answer (what a job waits for) and the host removal that goes on behind it."""
    client = server.client()
    answer, removal = [], []
    for _ in range(n):
        sb = client.sandboxes.create()
        sb.exec("true")
        started = time.perf_counter()
        client.sandboxes.delete(sb.id)
        answer.append(time.perf_counter() - started)
        server.wait_for_teardown()
        removal.append(time.perf_counter() - started)
        time.sleep(0.5)  # let the pool refill (untimed)
    return {"answer": summary(answer), "removed": summary(removal)}


def interpreter_starts(client: Any, n: int) -> list[float]:
    """``python3 -c 'import json'`` through exec in one sandbox: the JSON job's interpreter."""
    sb = client.sandboxes.create()
    try:
        sb.exec("python3 -c 'import json'")
        return [timed(lambda: sb.exec("python3 -c 'import json'")) for _ in range(n)]
    finally:
        sb.kill()


def guest_costs(client: Any, n: int) -> dict[str, Any]:
    """What each process start of the JSON job's one exec costs, alternating in one sandbox: the
    job's interpreter bare, its guard's pieces alone (``timeout``, ``sh -c``, ``dd``), and the
    folded line around ``true`` and around the job (where a missed JSON-job target goes)."""
    from pandastack_jobs import guest

    env = guest.job_env("/work/result.json", {})
    trailer = guest.ResultTrailer("/work/result.json", 1024 * 1024)
    lines = {
        "true": "true",
        "timeout_true": "timeout 60 true",
        "sh_c_true": "sh -c true",
        "dd_result": "dd if=/work/result.json bs=65536 count=100 iflag=count_bytes,nonblock status=none",
        "folded_true": guest.job_script("true", 60, env, {}, trailer),
        "import_json": "python3 -c 'import json'",
        "run_py": "cd /work && python3 run.py",
        "folded_run_py": guest.job_script("python3 run.py", 60, env, {}, trailer),
    }
    sb = client.sandboxes.create()
    try:
        sb.filesystem.write("/work/run.py", JOB_CODE)
        sb.filesystem.write("/work/input.json", json.dumps(JOB_INPUT))
        assert sb.exec("cd /work && python3 run.py").exit_code == 0
        samples = interleaved({k: (lambda line=line: sb.exec(line)) for k, line in lines.items()}, n, 1, 1)
    finally:
        sb.kill()
    return {k: summary(v) for k, v in samples.items()}


def runsc_floor(n: int) -> dict[str, Any]:
    """runsc's own costs here with nothing inside (``sleep`` in an empty root, no agent, the
    server's flags): what no gVisor sandbox can start, checkpoint or restore below."""
    from pandastack_local.isolation.gvisor.backend import RUNSC_FLAGS, check_runsc

    runsc, _ = check_runsc(None)
    base = Path(tempfile.mkdtemp(prefix="gvfloor-", dir="/tmp"))
    try:
        (base / "rootfs" / "usr").mkdir(parents=True)
        for name in ("bin", "lib", "lib64"):
            if Path("/", name).is_symlink():
                (base / "rootfs" / name).symlink_to(os.readlink(Path("/", name)))
        config = {
            "ociVersion": "1.0.2",
            "process": {"args": ["/usr/bin/sleep", "600"], "cwd": "/", "user": {"uid": 0, "gid": 0}},
            "root": {"path": str(base / "rootfs"), "readonly": True},
            "mounts": [{"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]}],
            "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]},
        }
        (base / "config.json").write_text(json.dumps(config))
        out: dict[str, list[float]] = {"run": [], "checkpoint": [], "restore": []}
        sizes: list[float] = []

        def runsc_cmd(state: str, *args: str) -> float:
            """Seconds one runsc command takes (--detach: it returns once the container runs)."""
            argv = [runsc, "--root", str(base / state), *RUNSC_FLAGS, *args]
            started = time.perf_counter()
            subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
            return time.perf_counter() - started

        for i in range(n):
            image = str(base / f"image-{i}")
            out["run"].append(runsc_cmd("s", "run", "--detach", "--bundle", str(base), f"a{i}"))
            out["checkpoint"].append(
                runsc_cmd("s", "checkpoint", "--compression=none", "--image-path", image, f"a{i}")
            )
            sizes.append(tree_mib(Path(image)))
            runsc_cmd("s", "delete", "--force", f"a{i}")
            out["restore"].append(
                runsc_cmd("r", "restore", "--detach", "--image-path", image, "--bundle", str(base), f"b{i}")
            )
            runsc_cmd("r", "delete", "--force", f"b{i}")
            shutil.rmtree(image, ignore_errors=True)
        return {**{k: summary(v) for k, v in out.items()}, "image_mib": max(sizes, default=0.0)}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def measure(isolation: str, n: int) -> dict[str, Any]:
    from pandastack_local import LocalServer

    out: dict[str, Any] = {}
    with LocalServer(isolation=isolation, pool_size=2) as server:
        client = server.client()
        time.sleep(3)
        out["pool_create"] = summary(pool_creates(server, n))
        jobs, steps = pooled_jobs(client, n)
        out["json_job"] = summary(jobs)
        out["json_job_steps"] = {k: summary(v) for k, v in steps.items()}
        out["delete"] = deletes(server, n)
        out["json_job_burst"] = summary([timed(lambda: core_job(client)) for _ in range(n)])
        out["interpreter_start"] = summary(interpreter_starts(client, n))
        out["guest_costs"] = guest_costs(client, n)
        out["fork"] = summary(forks(client, n))
        out["idle_memory_mib"] = idle_memory_mib(client)
        out["job_cpu_ms"] = job_cpu_ms(client, max(3, n // 2))
    with LocalServer(isolation=isolation, pool_size=0) as server:
        client = server.client()
        cold = []
        for _ in range(n):
            started = time.perf_counter()
            sb = client.sandboxes.create()
            cold.append(time.perf_counter() - started)
            sb.kill()
        out["cold_create"] = summary(cold)
        out["boot_image_mib"] = tree_mib(server.state_dir / "gvisor-images")
    return out


def main() -> None:
    args = int_options(n=10)
    data: dict[str, Any] = {"machine": machine()}
    for isolation in BACKENDS:
        log(f"gvisor: {isolation}, N = {args.n}")
        data[isolation] = measure(isolation, args.n)
    log("gvisor: runsc floor")
    data["runsc_floor"] = runsc_floor(args.n)
    log(f"gvisor written to {write_json('gvisor', data)}")


if __name__ == "__main__":
    main()
