"""``PandaStackExecutor``: every task try in its own fresh PandaStack sandbox.

An Airflow 3.3 executor on the engine of :mod:`.engine` (the shape of Airflow's
``common.sandbox``): the scheduler hands over an ``ExecuteTask`` workload, the executor
launches Airflow's standard Task SDK workload command in a fresh sandbox through the
:class:`~airflow_provider.executors.driver.PandaStackDriver`, polls it, and reports the end.
The task itself talks to the Execution API with its task-scoped token, exactly as on a
Celery or Kubernetes worker.

What is PandaStack's here: the connection and driver, the launch configuration
(:mod:`.launch`: ``template``, ``timeout``, ``ttl``, ``env``, validated by the core's job
declaration), the sandbox's runtime environment, the task-log relay (:mod:`.task_logs`) and
the orphan sweep (:mod:`.orphans`), and warm starts (:mod:`.warm`: ``warm_pool_size`` standbys
with the Task SDK already imported, opt-in).

Configuration lives in the ``[pandastack_executor]`` section; a task overrides
``template``, ``timeout``, ``ttl`` and ``env`` with ``executor_config={"pandastack": {...}}``.
"""

from __future__ import annotations

import sys
from typing import Any, ClassVar

from airflow.executors.base_executor import get_execution_api_server_url
from airflow.executors.workloads import ExecuteTask

from pandastack_jobs import Redactor, WarmStart

from .contract import SandboxDriver
from .driver import PandaStackDriver
from .engine import WORKLOAD_MODULE, SandboxExecutorEngine
from .hints import failure_hint
from .launch import PandaStackLaunchConfig
from .models import (
    SandboxConfigurationError,
    SandboxExecutionRef,
    SandboxLaunchConfig,
    SandboxOutput,
    SandboxResult,
    SandboxState,
)
from .options import SECTION
from .orphans import OrphanSweep, owners_alive, scheduler_owner
from .task_logs import GUEST_LOG_FOLDER, TaskLogRelay, failure_lines

CONFIG_SECTION = SECTION
# Beside an executor that does not pre-assign the try's UUID, Airflow gives it only to tasks whose
# executor= is the configured alias or module path: configure this alias to use the short name.
ALIAS = "PandaStackExecutor"
ALIAS_CONFIG = f"{ALIAS}:airflow_provider.executors.PandaStackExecutor"
# Inside the sandbox: Airflow's home lives in the throwaway work dir.
GUEST_AIRFLOW_HOME = "/work/airflow"
WORKER_CLIENT_OPTIONS = (
    "execution_api_timeout",
    "execution_api_retries",
    "execution_api_retry_wait_min",
    "execution_api_retry_wait_max",
)
# What a standby's runner imports before its try arrives (never DAG code): the workload's entry
# point, which pulls in the Task SDK's task runner, its API client and Airflow's configuration.
WARM_MODULES: tuple[str, ...] = (WORKLOAD_MODULE,)
# What every try imports later, after its start (imported if this Airflow has them; a missing one
# is skipped, never a failed standby). Measured inside a sandbox after WORKLOAD_MODULE: the DAG
# bag the task runner parses the DAG file with 300-625 ms, the supervisor ~17 ms, the @task
# decorator's module ~20 ms; none starts a thread (the runner forks).
WARM_OPTIONAL_MODULES: tuple[str, ...] = (
    "airflow.dag_processing.dagbag",
    "airflow.sdk.execution_time.supervisor",
    "airflow.providers.standard.decorators.python",
    "setproctitle",
)


class PandaStackExecutor(SandboxExecutorEngine):
    """Runs each task try in its own throwaway PandaStack sandbox (Airflow's sandbox-executor contract)."""

    driver_id: ClassVar[str] = PandaStackDriver.driver_id
    config_section: ClassVar[str] = CONFIG_SECTION

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        options, get = self.options, self.conf.get
        self.conn_id: str = options["pandastack_conn_id"]
        self.python: str = options["python"] or sys.executable
        self.execution_api_url = options["execution_api_server_url"] or get_execution_api_server_url(
            self.conf
        )
        self.dags_folder: str = options["dags_folder"] or get("core", "dags_folder", fallback="") or ""
        self.launch_config: PandaStackLaunchConfig = options["launch_config"]
        self.task_logs = TaskLogRelay(get("logging", "base_log_folder", fallback="") or "", self.log)
        self.orphans = OrphanSweep(options["orphan_sweep_interval"], self.driver_id, self.task_logs, self.log)
        self.orphans.clock = lambda: self.clock()
        self.warm_pool_size: int = options["warm_pool_size"]

    def read_options(self) -> tuple[dict[str, Any], list[str]]:
        """The engine's reading plus the launch defaults (the core checks template, timeout, ttl
        and env): one error for every bad option."""
        values, problems = super().read_options()
        try:
            values["launch_config"] = PandaStackLaunchConfig.from_section(self.conf.get, self.config_section)
        except SandboxConfigurationError as exc:
            problems.append(str(exc))
        return values, problems

    def start(self) -> None:
        """Start the engine, then the standby pool when ``warm_pool_size`` asks for one.

        The standbys name this scheduler's job (set before ``start``): once it is gone, another
        scheduler's sweep deletes its idle standbys."""
        super().start()
        if self.warm_pool_size and isinstance(self.driver, PandaStackDriver):
            try:
                owner = scheduler_owner(self.job_id)
            except Exception:  # unnamed standbys: other sweeps leave them to their idle TTL
                self.log.warning("%s: could not read this scheduler's job", self.label, exc_info=True)
                owner = {}
            keys = self.driver.open_standbys([self.warm_start()], self.warm_pool_size, owner=owner)
            self.log.info("%s: keeping %d standby(s) warm (key %s)", self.label, self.warm_pool_size, keys)

    def warm_start(self) -> WarmStart:
        """The one warm key: the section's template and env, as every try without overrides has them.

        A try whose template or import environment differs (a task's ``executor_config``) goes cold.
        """
        return WarmStart(
            template=self.launch_config.template,
            python=self.python,
            modules=WARM_MODULES,
            optional_modules=WARM_OPTIONAL_MODULES,
            env=self.runtime_env(dict(self.launch_config.env)),
        )

    # -- driver and launch -------------------------------------------------------------------------

    def make_driver(self) -> SandboxDriver:
        """The driver, with the PandaStack key resolved here, in the scheduler (never in a sandbox)."""
        from airflow.models.connection import Connection

        from airflow_provider.hooks.pandastack import config_from_connection

        try:
            conn = Connection.get_connection_from_secrets(self.conn_id)
        except Exception:
            if self.conn_id != "pandastack_default":
                raise
            conn = None
        config = config_from_connection(conn)  # type: ignore[arg-type]
        return PandaStackDriver(config, redactor=Redactor([config.api_key]), owners_alive=owners_alive)

    def missing_request_id(self, ti: Any) -> str:
        return (
            f"task {ti.key} has no pre-assigned external_executor_id (the try's UUID). Beside an "
            "executor that does not pre-assign one (LocalExecutor, KubernetesExecutor), Airflow "
            "pre-assigns it only when the task's executor= is the configured name: configure "
            f"[core] executor = ...,{ALIAS_CONFIG} and use executor={ALIAS!r} (needs Airflow >= 3.3)"
        )

    def build_launch_config(self, workload: ExecuteTask) -> SandboxLaunchConfig:
        """The section's defaults with the task's ``executor_config`` over them, the try's labels."""
        ti = workload.ti
        labels = {
            "dag_id": ti.dag_id,
            "task_id": ti.task_id,
            "run_id": ti.run_id,
            "map_index": str(ti.map_index),
            "try_number": str(ti.try_number),
        }
        return self.launch_config.overlay(ti.executor_config).sandbox_config(labels)

    def workload_command(self, workload: ExecuteTask) -> list[str]:
        """The Task SDK workload command, with the interpreter the sandbox has (``python``)."""
        return [self.python, "-m", WORKLOAD_MODULE, "--json-string", workload.model_dump_json()]

    def runtime_env(self, task_env: dict[str, str]) -> dict[str, str]:
        """What the sandbox's environment holds: the task's env plus the Airflow runtime variables.

        Nothing else: no metadata DB URL, no fernet key, no PandaStack key. The only
        credential is the workload's own task-scoped Execution API token.
        """
        env = dict(task_env)
        env.update(
            {
                "AIRFLOW_HOME": GUEST_AIRFLOW_HOME,
                "AIRFLOW_IS_EXECUTOR_CONTAINER": "true",
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": self.execution_api_url,
                "AIRFLOW__CORE__DAGS_FOLDER": self.dags_folder,
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__LOGGING__BASE_LOG_FOLDER": GUEST_LOG_FOLDER,
                # The sandbox parses the DAG again and checks every task's executor= against this
                # list: without it a task with executor="PandaStackExecutor" never loads there.
                "AIRFLOW__CORE__EXECUTOR": self.conf.get("core", "executor", fallback="") or "",
            }
        )
        # The Task SDK's API client settings, as the workers here have them (no secrets in them).
        for option in WORKER_CLIENT_OPTIONS:
            value = self.conf.get("workers", option, fallback=None)
            if value:
                env[f"AIRFLOW__WORKERS__{option.upper()}"] = str(value)
        return env

    def handle_data(self, workload: ExecuteTask) -> dict[str, Any]:
        return {"log_path": workload.log_path} if workload.log_path else {}

    # -- the end of a try: the task log ------------------------------------------------------------

    async def collect_end(
        self, ref: SandboxExecutionRef, result: SandboxResult
    ) -> tuple[bytes | None, SandboxOutput | None]:
        """The task log and (on failure) the output tail, read before the sandbox is deleted."""
        assert self.driver is not None
        if result.state is SandboxState.GONE:
            return None, None
        log = await self.task_logs.read(self.driver, ref)
        output: SandboxOutput | None = None
        if result.state is SandboxState.FAILED:
            try:
                output = await self.driver.get_output(ref.handle)
            except Exception:
                self.log.warning("could not read the output of %s", ref.request_id, exc_info=True)
        return log, output

    def report_end(self, ref: SandboxExecutionRef, result: SandboxResult, collected: Any) -> str | None:
        log, output = collected if collected is not None else (None, None)
        lines: list[str] = []
        if result.state is not SandboxState.SUCCEEDED:
            text = "" if output is None else output.stdout + "\n" + output.stderr
            hint = failure_hint(result, text, self.python, self.execution_api_url)
            lines = failure_lines(ref, result, output, hint)
        self.task_logs.write(ref.handle.data.get("log_path"), log, lines)
        return lines[0] if lines else result.message

    def report_not_started(self, workload: ExecuteTask, message: str) -> None:
        self.task_logs.write(workload.log_path, None, [message])

    # -- orphans -----------------------------------------------------------------------------------

    def sweep(self) -> None:
        if self.driver is None or self._loop is None:
            return
        self.orphans.drain()
        self.orphans.tick(self.driver, self._submit, self.owned_requests)

    def owned_requests(self) -> set[str]:
        return super().owned_requests() | self.orphans.requests
