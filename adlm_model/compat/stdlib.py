"""The standard library's private names the model uses, and why no public API serves each."""

from __future__ import annotations

from . import PrivateName

COMPAT_PICKLE = PrivateName("_compat_pickle", None, "pickle's own table of Python 2 module and class names, which "
                            "the unpickler applies to protocol <= 2 pickles; the safe unpickler applies the same one",
                            "adlm_model/compat/stdlib.py")
PRIVATE = [COMPAT_PICKLE]


def python2_name(module: str, name: str) -> tuple[str, str]:
    """``(module, name)`` as pickle reads a Python 2 global (``__builtin__`` -> ``builtins``)."""
    table = COMPAT_PICKLE.load()
    if (module, name) in table.NAME_MAPPING:
        return table.NAME_MAPPING[(module, name)]
    return table.IMPORT_MAPPING.get(module, module), name
