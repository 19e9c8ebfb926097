"""The ``[pandastack_executor]`` options, declared once: the provider info's ``config`` section is
built from :data:`OPTIONS` (as Airflow's providers declare theirs in ``provider.yaml``), and the
executor reads and checks them all at once (:func:`read_section`), so a scheduler with three bad
options hears of all three, each named, instead of the first one found.

Import-light (no Airflow, nothing of the executor): ``get_provider_info`` imports it while Airflow
discovers providers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

SECTION = "pandastack_executor"
MAX_WARM_POOL_SIZE = 64
# The job options a task may also set (executor_config); read by the core's declaration (launch.py).
TASK_OPTIONS = ("template", "timeout", "ttl", "env")

Getter = Callable[..., Any]
"""``conf.get``: ``get(section, option, fallback=None)``."""


@dataclass(frozen=True)
class Option:
    """One option: Airflow's provider-config fields (``type`` is one of Airflow's: string, integer,
    float, boolean) and the check that turns its text into the value the executor uses."""

    name: str
    type: str
    default: str | None
    description: str
    example: str | None = None


OPTIONS: tuple[Option, ...] = (
    Option("pandastack_conn_id", "string", "pandastack_default",
           "The PandaStack connection; its key is resolved in the scheduler only."),
    Option("template", "string", None,
           "The sandbox template: one with the workers' Python environment and the DAGs. "
           "Default: the core's (code-interpreter, which has no Airflow).", "airflow-worker"),
    Option("timeout", "integer", None,
           "Hard clock per try in whole seconds, enforced inside the sandbox. Default: 3600.", "3600"),
    Option("ttl", "integer", None,
           "The sandbox's idle backstop in seconds. Default: the core's rule, timeout + 60.", "3660"),
    Option("env", "string", None, "Extra environment for every try, a JSON object of strings; "
           "AIRFLOW_* names are refused.", '{"TZ": "UTC"}'),
    Option("python", "string", None,
           "The interpreter inside the sandbox. Default: the scheduler's sys.executable.",
           "/opt/airflow-venv/bin/python"),
    Option("execution_api_server_url", "string", None,
           "The Execution API as seen from the sandbox. Default: [core] execution_api_server_url.",
           "http://127.0.0.1:8080/execution/"),
    Option("dags_folder", "string", None,
           "The DAG folder as seen from the sandbox. Default: [core] dags_folder.", "/opt/airflow/dags"),
    Option("poll_interval", "float", "1", "Seconds between status polls of a running try (> 0)."),
    Option("launch_concurrency", "integer", "8", "Sandbox launches and polls in flight at once (> 0)."),
    Option("adoption_timeout", "float", "30",
           "Seconds a restarted scheduler waits to recover one try's sandbox (>= 0)."),
    Option("shutdown_timeout", "float", "30",
           "Seconds the executor's end waits for launches in flight and fences (>= 0)."),
    Option("check_health_on_startup", "boolean", "True",
           "Check the credentials and that PandaStack answers when the executor starts."),
    Option("orphan_sweep_interval", "float", "60",
           "Seconds between orphan sweeps (sandboxes of tries that ended); 0 turns the sweep off."),
    Option("warm_pool_size", "integer", "0",
           f"Standbys kept ready with the Task SDK already imported (0 to {MAX_WARM_POOL_SIZE}); 0 = off."),
)  # fmt: skip
BY_NAME = {option.name: option for option in OPTIONS}


def provider_config() -> dict[str, Any]:
    """The ``config`` entry of ``get_provider_info``: Airflow shows these in ``airflow config list``
    and uses the defaults where airflow.cfg sets nothing."""
    return {
        SECTION: {
            "description": "PandaStackExecutor: every task try in its own throwaway PandaStack sandbox.",
            "options": {
                o.name: {
                    "description": o.description,
                    "version_added": None,
                    "type": o.type,
                    "example": o.example,
                    "default": o.default,
                }
                for o in OPTIONS
            },
        }
    }


def _number(text: str, kind: type, minimum: float, strict: bool) -> Any:
    value = kind(text)
    if value < minimum or (strict and value == minimum):
        raise ValueError
    return value


# name -> (parse, what a good value is); parse raises ValueError on a bad text.
_CHECKS: dict[str, tuple[Callable[[str], Any], str]] = {
    "poll_interval": (lambda t: _number(t, float, 0, True), "a number of seconds > 0, e.g. 1"),
    "launch_concurrency": (lambda t: _number(t, int, 0, True), "a whole number > 0, e.g. 8"),
    "adoption_timeout": (lambda t: _number(t, float, 0, False), "a number of seconds >= 0, e.g. 30"),
    "shutdown_timeout": (lambda t: _number(t, float, 0, False), "a number of seconds >= 0, e.g. 30"),
    "orphan_sweep_interval": (
        lambda t: _number(t, float, 0, False),
        "a number of seconds >= 0, e.g. 60 (0 turns the sweep off)",
    ),
    "warm_pool_size": (
        lambda t: _pool_size(_number(t, int, 0, False)),
        f"a whole number from 0 to {MAX_WARM_POOL_SIZE}: the ready standbys to keep, e.g. 2 (0 turns "
        "warm starts off)",
    ),
    "check_health_on_startup": (lambda t: _boolean(t), "True or False"),
}


def _pool_size(size: int) -> int:
    if size > MAX_WARM_POOL_SIZE:
        raise ValueError
    return size


def _boolean(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "t", "1", "yes", "on"):
        return True
    if lowered in ("false", "f", "0", "no", "off"):
        return False
    raise ValueError


def read_section(get: Getter, section: str = SECTION) -> tuple[dict[str, Any], list[str]]:
    """Every declared option of ``[section]`` as its value (its default when unset or empty; None
    where the default is derived elsewhere), and one problem per bad option, each naming it and a
    good value. The job options (template, timeout, ttl, env) are returned as text: the core's
    declaration reads them (launch.py)."""
    values: dict[str, Any] = {}
    problems: list[str] = []
    for option in OPTIONS:
        raw = get(section, option.name, fallback=None)
        text = "" if raw is None else str(raw).strip()
        if not text:
            text = option.default or ""
        check = _CHECKS.get(option.name)
        if check is None:
            values[option.name] = text or None
            continue
        parse, good = check
        try:
            values[option.name] = parse(text)
        except ValueError:
            problems.append(f"[{section}] {option.name}: {raw!r} is not {good}")
    return values, problems


def config_error(section: str, problems: list[str]) -> str:
    """One message for every bad option (each on its own line)."""
    count = f"{len(problems)} bad option" + ("s" if len(problems) > 1 else "")
    return f"[{section}]: {count}; fix each:\n" + "\n".join(f"  {p}" for p in problems)


def unknown_options(section_items: Mapping[str, Any] | None, section: str = SECTION) -> list[str]:
    """The problems for options ``[section]`` sets that nothing reads (a typo is otherwise silent)."""
    if not section_items:
        return []
    known = ", ".join(sorted(BY_NAME))
    return [
        f"[{section}] {name}: not an option of this executor; the options are {known}"
        for name in sorted(section_items)
        if name.lower() not in BY_NAME
    ]
