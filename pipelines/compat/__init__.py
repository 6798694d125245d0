"""Adapters for the private names of Ray and MLflow: the only modules of ``pipelines`` that may import one.

One module per package (``ray``, ``mlflow``), each naming why no public API serves and failing in one line when a
name has gone (``PrivateName.load``); ``tests/repo/test_compat.py`` loads every one of them. Nothing here imports Ray or
MLflow until a function is called, nor torch at all: a command's ``--help`` and the data stage stay light. That is
also why ``PrivateName`` is defined here as well as in ``adlm_model.compat`` (importing any ``adlm_model`` module
imports torch).
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
    """One private name of Ray or MLflow: where it lives, why no public API serves, the adapter that uses it."""

    module: str
    attr: str | None
    why: str
    adapter: str

    def load(self) -> Any:
        """The module (``attr`` None) or its attribute; ``MissingPrivateAPI`` naming the release and the adapter."""
        try:
            found = importlib.import_module(self.module)
            return found if self.attr is None else getattr(found, self.attr)
        except (ImportError, AttributeError) as e:
            package = self.module.partition(".")[0]
            try:
                release = f"{package} {metadata.version(package)}"
            except metadata.PackageNotFoundError:
                release = package
            name = ".".join(p for p in (self.module, self.attr) if p)
            raise MissingPrivateAPI(f"{name} is not in the installed {release} ({self.why}): update "
                                    f"{self.adapter} for this release, or install requirements.lock") from e
