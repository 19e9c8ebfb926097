"""Function jobs: run a Python function's source in the sandbox, with JSON in and JSON out.

Used by ``@task.pandastack`` and ``@sandbox_task``. The function's source is
shipped as a script; arguments cross as JSON and the return value comes back
as JSON. Nothing is pickled in either direction, so a hostile job can return
data but never code.
"""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .exceptions import JobArgumentsError
from .spec import INPUT_PATH, RESULT_PATH, WORKDIR

SCRIPT_NAME = "_pandastack_fn.py"
SCRIPT_PATH = f"{WORKDIR}/{SCRIPT_NAME}"
# The script and its input and result follow the job's own work directory (``$JOB_WORKDIR``,
# ``$JOB_INPUT``, ``$JOB_RESULT``, see guest.job_env): a queue chunk's mates each run in their
# own (pandastack_jobs/queue/chunks.py), where fixed /work paths would miss every one of them.
# The defaults keep a plain job's paths when the variables are unset.
COMMAND = f'python3 "${{JOB_WORKDIR:-{WORKDIR}}}/{SCRIPT_NAME}"'

_RUNNER = """

if __name__ == "__main__":
    import json as _json
    import os as _os

    with open(_os.environ.get("JOB_INPUT", {input_path!r}), encoding="utf-8") as _f:
        _payload = _json.load(_f)
    _value = {name}(*_payload["args"], **_payload["kwargs"])
    with open(_os.environ.get("JOB_RESULT", {result_path!r}), "w", encoding="utf-8") as _f:
        _json.dump(_value, _f)
"""


def function_source(fn: Callable[..., Any]) -> str:
    """The function's own source with its decorators removed (they belong to the orchestrator)."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as exc:
        raise JobArgumentsError(
            "python_callable",
            f"the source of {getattr(fn, '__name__', fn)!r} cannot be read ({exc})",
            "define the function in a .py file (not a lambda, REPL or notebook cell)",
        ) from None
    tree = ast.parse(source)
    node = tree.body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or isinstance(
        node, ast.AsyncFunctionDef
    ):
        raise JobArgumentsError(
            "python_callable", "is not a plain function", "decorate a regular `def` function"
        )
    node.decorator_list = []
    return ast.unparse(node)


def check_json(value: Any, field: str) -> None:
    """Raise :class:`JobArgumentsError` naming ``field`` if ``value`` cannot cross as JSON."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise JobArgumentsError(
            field,
            f"cannot cross the sandbox wall as JSON ({exc})",
            "pass JSON values only (dict, list, str, int, float, bool, None); nothing is pickled",
        ) from None


def function_job(
    fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The ``command``, ``files`` and ``input`` of a :class:`JobSpec` that calls ``fn(*args, **kwargs)``."""
    kwargs = dict(kwargs or {})
    for i, arg in enumerate(args):
        check_json(arg, f"args[{i}]")
    for name, arg in kwargs.items():
        check_json(arg, f"kwargs[{name!r}]")
    # Annotations stay text: the names they use (typing's Any, the caller's classes) are not in the
    # sandbox, where evaluating them would be a NameError before the body ran.
    script = (
        "from __future__ import annotations\n\n"
        + function_source(fn)
        + _RUNNER.format(name=fn.__name__, input_path=INPUT_PATH, result_path=RESULT_PATH)
    )
    return {
        "command": COMMAND,
        "files": {SCRIPT_PATH: script},
        "input": {"args": list(args), "kwargs": kwargs},
        "result_path": RESULT_PATH,
    }
