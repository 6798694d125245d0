"""Adapters for the private names of other packages: the only modules that may import one.

A private name (a leading underscore, ``_private``, ``_internal``) can change in any release of its package, as
MLflow 3.18 renamed a validator the registry imported. Each package gets one module here that imports its private
names, says why no public API serves, and fails with one clear line when a name has gone (``PrivateName.load``; ``pipelines.compat`` keeps a twin of it
that imports no torch).
``tests/repo/test_compat.py`` loads every listed name, so a release that drops one is found by the suite, not by a user;
``tests/repo/test_compat.py`` also refuses a private import anywhere else in ``adlm_model``, ``pipelines`` and
``benchmarks``. This subpackage imports torch and the standard library only: the model layers may use it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib import metadata
from typing import Any


class MissingPrivateAPI(ImportError):
    """A private name an adapter relies on is not in the installed package."""


@dataclass(frozen=True)
class PrivateName:
    """One private name of another package: where it lives and why no public API serves."""

    module: str
    attr: str | None
    """The attribute of ``module`` used, or None for the module itself."""
    why: str
    adapter: str
    """The adapter module that uses it (named in the error)."""

    def load(self) -> Any:
        """The module or attribute; ``MissingPrivateAPI`` naming the package's version and the adapter if gone."""
        try:
            mod = importlib.import_module(self.module)
            return mod if self.attr is None else getattr(mod, self.attr)
        except (ImportError, AttributeError) as e:
            dist = self.module.split(".")[0]
            try:
                version = f"{dist} {metadata.version(dist)}"
            except metadata.PackageNotFoundError:
                version = dist
            what = self.module if self.attr is None else f"{self.module}.{self.attr}"
            raise MissingPrivateAPI(f"{what} is not in the installed {version} ({self.why}): update {self.adapter} "
                                    f"for this release, or install the versions of requirements.lock") from e

