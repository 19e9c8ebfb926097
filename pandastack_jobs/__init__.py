"""pandastack_jobs: one throwaway PandaStack sandbox per job, engine-agnostic.

The lifecycle (create → deliver → exec under a hard timeout → collect →
delete), the classification of failures into redeliver or dead-letter, orphan
reaping and warm-parent fork pools live here, once. The Airflow provider and
the Prefect blocks only translate.
"""

from pandastack_workflows.moved import register

from .classify import Classifier
from .connection import ConnectionConfig
from .detached import DetachedJob, SandboxGone, finish_detached, poll_detached, start_detached
from .exceptions import JobArgumentsError, JobSpecError, PandaStackJobsError
from .forkpool import WarmPool, WarmupFailed
from .lifecycle import JobHandle, JobRun, reap_before, run_job
from .lines import LineSplitter
from .options import (
    NOT_GIVEN,
    JobOption,
    JobOptions,
    NotGiven,
    admits_none,
    coerce_options,
    given_options,
    job_option,
    job_options,
    merge_options,
    option_names,
    option_parameters,
    options_table,
    validate_options,
    with_parameters,
)
from .outcome import FailureClass, FailureKind, JobOutcome, Timings
from .pyfunc import function_job
from .reaper import (
    delete_sandbox,
    reap_earlier_attempts,
    sweep,
    sweep_forks,
    sweep_job,
    sweep_managed,
    sweep_run,
)
from .redact import Redactor, redact
from .spec import DEFAULT_PARENT_TTL, INPUT_PATH, RESULT_PATH, WORKDIR, Engine, JobKey, JobSpec
from .warm_start import Standby, StandbyPool, WarmStart

register({"pandastack_jobs.errors": "pandastack_jobs.exceptions"})

__all__ = [
    "DEFAULT_PARENT_TTL",
    "INPUT_PATH",
    "NOT_GIVEN",
    "RESULT_PATH",
    "WORKDIR",
    "Classifier",
    "ConnectionConfig",
    "DetachedJob",
    "Engine",
    "FailureClass",
    "FailureKind",
    "JobArgumentsError",
    "JobHandle",
    "JobKey",
    "JobOption",
    "JobOptions",
    "JobOutcome",
    "JobRun",
    "JobSpec",
    "JobSpecError",
    "LineSplitter",
    "NotGiven",
    "PandaStackJobsError",
    "Redactor",
    "SandboxGone",
    "Standby",
    "StandbyPool",
    "Timings",
    "WarmPool",
    "WarmStart",
    "WarmupFailed",
    "admits_none",
    "coerce_options",
    "delete_sandbox",
    "finish_detached",
    "function_job",
    "given_options",
    "job_option",
    "job_options",
    "merge_options",
    "option_names",
    "option_parameters",
    "options_table",
    "poll_detached",
    "reap_before",
    "reap_earlier_attempts",
    "redact",
    "run_job",
    "start_detached",
    "sweep",
    "sweep_forks",
    "sweep_job",
    "sweep_managed",
    "sweep_run",
    "validate_options",
    "with_parameters",
]
