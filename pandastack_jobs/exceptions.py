"""Exceptions raised by the core before any sandbox exists, and the base of all the core's.

A bad job spec is the caller's bug: it is reported at construction time, naming
the field and the fix, so nothing is created and nothing is lost. Every exception class of
``pandastack_jobs`` derives from :class:`PandaStackJobsError` too (and keeps its builtin).
"""

from __future__ import annotations


class PandaStackJobsError(Exception):
    """Base of every exception the core defines."""


class JobSpecError(PandaStackJobsError, ValueError):
    """A job spec field is invalid. The message names the field and how to fix it."""

    def __init__(self, field: str, problem: str, fix: str) -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}: {problem}. Fix: {fix}")


class JobArgumentsError(JobSpecError):
    """A function job's arguments or return value cannot cross the sandbox wall as JSON."""
