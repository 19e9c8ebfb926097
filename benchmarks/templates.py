"""What a template's software costs (issue 13): create and ``import pandas``, side by side.

Run: ``python -m benchmarks.templates [--n 40] [--imports 15]``. Writes
``benchmarks/results/templates.json`` and prints a table.

- create p50 from the warm pool, ``code-interpreter`` (its data stack bound read-only)
  vs ``base`` (nothing bound), alternating on one server: the bind must not slow a create.
- ``python3 -c "import pandas"``: as an exec in a code-interpreter sandbox (through the SDK,
  what a job sees) vs the same interpreter and environment run on the host, alternating.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.common import machine, summary, write_json
from pandastack_local import LocalServer
from pandastack_local.templates import build as template_build
from pandastack_local.templates.registry import BUILTIN_TEMPLATES

IMPORT = 'python3 -c "import pandas"'


def host_env() -> Path:
    """The built code-interpreter environment on the host (``make templates`` builds it)."""
    [ci] = [t for t in BUILTIN_TEMPLATES if t.name == "code-interpreter"]
    key = template_build.env_key(ci.requirements, ci.debs, template_build.guest_python_version())
    built = template_build.env_dir(template_build.default_cache_dir(), ci.name, key)
    if not template_build.is_built(built):
        raise SystemExit("code-interpreter is not built: run `make templates` first")
    return built / "venv"


def creates(client: Any, n: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {"base": [], "code-interpreter": []}
    for _ in range(n):
        for name in times:
            t0 = time.perf_counter()
            sb = client.sandboxes.create(template=name)
            times[name].append(time.perf_counter() - t0)
            client.sandboxes.delete(sb.id)
            time.sleep(0.05)  # let the pool refill: this measures a create from the pool
    return {name: summary(values) for name, values in times.items()}


def imports(client: Any, n: int, venv: Path) -> dict[str, Any]:
    sandbox: list[float] = []
    host: list[float] = []
    with client.sandboxes.create(template="code-interpreter") as sb:
        sb.exec(IMPORT)  # first import reads the files into the page cache, on both sides
        subprocess.run([str(venv / "bin/python3"), "-c", "import pandas"], check=True)
        for _ in range(n):
            t0 = time.perf_counter()
            out = sb.exec(IMPORT)
            sandbox.append(time.perf_counter() - t0)
            assert out.exit_code == 0, out.stderr
            t0 = time.perf_counter()
            subprocess.run([str(venv / "bin/python3"), "-c", "import pandas"], check=True)
            host.append(time.perf_counter() - t0)
    result = {"sandbox": summary(sandbox), "host": summary(host)}
    result["ratio_p50"] = round(result["sandbox"]["p50_ms"] / result["host"]["p50_ms"], 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--imports", type=int, default=15)
    args = parser.parse_args()
    venv = host_env()
    results: dict[str, Any] = {
        "machine": machine(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    with LocalServer() as server:
        client = server.client()
        creates(client, 3)  # warm-up
        results["create"] = {"n": args.n, **creates(client, args.n)}
        results["import_pandas"] = {"n": args.imports, **imports(client, args.imports, venv)}
    c = results["create"]
    c["ratio_p50"] = round(c["code-interpreter"]["p50_ms"] / c["base"]["p50_ms"], 3)
    write_json("templates", results)
    i = results["import_pandas"]
    print(f"create from the warm pool, ms (n={args.n}): p50 / p99")
    for name in ("base", "code-interpreter"):
        print(f"  {name:<17} {c[name]['p50_ms']:>8} {c[name]['p99_ms']:>8}")
    print(f"  code-interpreter / base p50: {c['ratio_p50']}")
    print(f'python3 -c "import pandas", ms (n={args.imports}): p50 / p99')
    print(f"  sandbox exec      {i['sandbox']['p50_ms']:>8} {i['sandbox']['p99_ms']:>8}")
    print(f"  host              {i['host']['p50_ms']:>8} {i['host']['p99_ms']:>8}")
    print(f"  sandbox / host p50: {i['ratio_p50']}")


if __name__ == "__main__":
    main()
