"""The one PNG of RESULTS.md: per-job latency by path, throughput by concurrency, RSS over jobs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR

PNG = RESULTS_DIR / "benchmarks.png"


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def plot() -> Path:
    """Draw what exists (a partial run still gets a plot) and return the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    overhead, prefect, scale, memory = (
        load("overhead"),
        load("prefect_overhead"),
        load("scale"),
        load("memory"),
    )
    ax = axes[0]
    bars: list[tuple[str, dict[str, Any]]] = []
    if overhead:
        bars += [("raw SDK", overhead["a_raw_sdk"]), ("core", overhead["b_core"])]
        bars += [("Airflow op", overhead["c_airflow"])]
    if prefect:
        bars += [("raw SDK\n(Prefect venv)", prefect["a_raw_sdk"]), ("Prefect task", prefect["d_prefect"])]
    xs = range(len(bars))
    ax.bar(xs, [b["p50_ms"] for _, b in bars], label="p50")
    ax.scatter(xs, [b["p99_ms"] for _, b in bars], color="black", marker="_", s=400, label="p99")
    ax.set_xticks(list(xs), [name for name, _ in bars], fontsize=8)
    ax.set_ylabel("ms per job")
    ax.set_title("(1) one small job, per path")
    ax.legend()
    ax = axes[1]
    if scale:
        levels = scale["levels"]
        ax.plot([lv["concurrency"] for lv in levels], [lv["throughput_jobs_per_s"] for lv in levels], "o-")
        for lv in levels:
            ax.annotate(
                f"peak {lv['peak_live_sandboxes']} live", (lv["concurrency"], lv["throughput_jobs_per_s"])
            )
    ax.set_xlabel("concurrent jobs (threads)")
    ax.set_ylabel("jobs / s")
    ax.set_title("(4) throughput, 200 jobs per level")
    ax = axes[2]
    if memory:
        ax.plot([s["jobs"] for s in memory["samples"]], [s["rss_mb"] for s in memory["samples"]], "o-")
        ax.set_ylim(0, max(s["rss_mb"] for s in memory["samples"]) * 1.3)
    ax.set_xlabel("jobs run")
    ax.set_ylabel("orchestrator RSS (MiB)")
    ax.set_title("(6) orchestrator memory over 1,000 jobs")
    m = (overhead or scale or memory or {}).get("machine", {})
    fig.suptitle(
        f"pandastack-workflows on pandastack-local - {m.get('cpus')} CPUs, {m.get('memory_gib')} GiB, "
        f"kernel {m.get('kernel')}, Python {m.get('python')}, pandastack {m.get('pandastack')}, "
        f"{m.get('when')}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(PNG, dpi=90)
    plt.close(fig)
    return PNG
