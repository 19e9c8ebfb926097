"""The old import paths of renamed modules: they still import, with a DeprecationWarning.

A DAG or flow written against ``airflow_provider.operators.pool`` keeps working after the module
became ``airflow_provider.operators.warm_fork``: the old name resolves to the new module itself (the
same classes, so ``isinstance`` and serialised DAGs agree), and the import warns once per process.
No file stands at an old path, so nothing there can drift from the real module. Each package
registers its own old names (:func:`register`) when it is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Mapping, Sequence
from types import ModuleType

_MOVED: dict[str, str] = {}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module name, before any file finder (a stale old file must not win), and
    loads the new module."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def exec_module(self, module: ModuleType) -> None:
        new = _MOVED[module.__name__]
        warnings.warn(
            f"{module.__name__} is deprecated: import {new} (the same names)",
            DeprecationWarning,
            stacklevel=2,
        )
        # The import system returns what sys.modules holds after this: the new module itself.
        sys.modules[module.__name__] = importlib.import_module(new)


_FINDER = _MovedFinder()


def register(moved: Mapping[str, str]) -> None:
    """Make each old module name (a key) import the new one (its value), with a warning."""
    _MOVED.update(moved)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
