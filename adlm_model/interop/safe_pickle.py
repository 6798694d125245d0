"""Reading the references' pickled checkpoints (Lightning ``.ckpt``, ``pytorch_model.bin``) without running them.

A ``.ckpt`` is a pickle: loading one with plain ``torch.load`` runs whatever callable it names. The references'
checkpoints hold more than tensors: MDLM's Lightning module saves its hyper-parameters (an OmegaConf
``DictConfig``) *and its tokenizer object* (``transformers`` / ``tokenizers`` classes), which
``torch.load(weights_only=True)`` refuses and which this code must never import. So the file goes through
``torch.load`` with a restricted unpickler:

- tensors, storages, dtypes, ``torch.Size``, ``OrderedDict`` / ``defaultdict``, builtin containers and numpy
  arrays are rebuilt as they are (the allowlist below, all data constructors);
- any other *class* (CapWords name) of a module outside the denylist becomes an inert stand-in (:class:`Opaque`)
  that keeps the arguments and state the pickle gives it and runs nothing; the OmegaConf containers and nodes
  and Lightning's ``AttributeDict`` among them are turned into plain dicts, lists and values by :func:`plain`;
- everything else (a function such as ``os.system`` or ``builtins.eval``, or anything from ``os``,
  ``subprocess``, ``builtins``, ...) is refused with :class:`UnsafePickleError`, before it is called.

Names are first translated as pickle itself would (Python 2's ``commands.Popen`` is ``subprocess.Popen``,
``__builtin__`` is ``builtins``: ``_compat_pickle``), so an old spelling cannot slip past the checks. No allowed
constructor allocates by a number the file states: ``bytes(n)`` / ``bytearray(n)`` and a numpy array rebuilt
with a shape other than numpy's own ``(0,)`` placeholder are refused, and the tensors' storages may not declare
more bytes than the file holds, so a file of a few hundred bytes cannot make the loader allocate gigabytes.

numpy reaches native code, so nothing of numpy is built from what the file says until it is checked: a dtype is a
plain number type (booleans, integers, floats, complex numbers of at most 32 bytes; never ``object``, a void, a
string or a structured dtype) given by its type code, an array's data are bytes of exactly its shape's size (an
``object`` array's data, pointers read from the file, would crash the process), and a numpy scalar's data are
bytes of its dtype's size. A file that is not a readable ``torch.save`` pickle at all (empty, truncated,
corrupt) is :class:`UnreadablePickleError`, one line; so is a hyper-parameter tree nested deeper than
``MAX_DEPTH`` levels (:func:`plain`).

Nothing outside the allowlist is ever imported, so loading cannot run code of the file's choosing.
"""

from __future__ import annotations

import codecs
import collections
import math
import os
import pickle
import re
import types
import zipfile
from typing import Any

import numpy as np
import torch

from ..compat.stdlib import python2_name
from ..compat.torch import rebuild_functions

# Modules whose names are refused outright (even CapWords ones): what a planted pickle reaches for.
DENIED_MODULES = frozenset({
    "os", "posix", "nt", "sys", "subprocess", "builtins", "__builtin__", "shutil", "importlib", "runpy",
    "pickle", "_pickle", "marshal", "types", "ctypes", "socket", "code", "codeop", "pty", "webbrowser", "io",
    "_io", "operator", "functools", "inspect", "multiprocessing", "threading", "signal", "tempfile", "glob", "urllib", "http", "requests", "asyncio", "platform", "_posixsubprocess", "pdb", "timeit", "sysconfig",
})

_BUILTINS: dict[str, Any] = {n: getattr(__import__("builtins"), n) for n in (
    "dict", "list", "tuple", "set", "frozenset", "int", "float", "bool", "str", "bytes", "bytearray", "complex",
    "slice", "object")}


class UnsafePickleError(ValueError):
    """A pickle that names something loading would run (code, not data) or that would allocate by a number it
    states (``ALLOCATES``)."""


ALLOCATES = "allocates by a number in the file"
NOT_PLAIN = "only plain number types are read from a pickle"


class UnreadablePickleError(ValueError):
    """A file that is not a readable ``torch.save`` pickle (empty, truncated, corrupt)."""


def _sized(kind: type) -> Any:
    """``bytes`` / ``bytearray`` from data only: ``bytes(n)`` would allocate n bytes for a number in the file."""
    def build(*args: Any) -> Any:
        if args and isinstance(args[0], int):
            raise UnsafePickleError(f"builtins.{kind.__name__}({args[0]}) ({ALLOCATES})")
        return kind(*args)

    build.__name__ = kind.__name__
    return build


_BUILTINS["bytes"], _BUILTINS["bytearray"] = _sized(bytes), _sized(bytearray)


def _latin1(obj: Any, encoding: str = "utf-8", errors: str = "strict") -> Any:
    """``_codecs.encode`` as pickle protocol 2 uses it (bytes written as a latin-1 string), nothing else."""
    if encoding.lower().replace("_", "-") not in ("latin1", "latin-1") or not isinstance(obj, str):
        raise UnsafePickleError(f"_codecs.encode(..., {encoding!r}) (only latin-1 strings are bytes in a pickle)")
    return codecs.encode(obj, "latin1", errors)


def _np(mod: str, name: str) -> Any:
    for m in (mod, mod.replace("numpy.core", "numpy._core"), mod.replace("numpy._core", "numpy.core")):
        try:
            return getattr(__import__(m, fromlist=[name]), name)
        except (ImportError, AttributeError):
            continue
    raise AttributeError(f"{mod}.{name}")


# Data constructors rebuilt as they are: (module, name) -> object.
ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "defaultdict"): collections.defaultdict,
    **rebuild_functions(),
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("_codecs", "encode"): _latin1,
    **{("builtins", n): v for n, v in _BUILTINS.items()},
}
_NUMPY = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
          ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
          ("numpy._core.multiarray", "scalar")}


class Opaque(dict):
    """An inert stand-in for a class the loader does not import: whatever the pickle hands it (constructor
    arguments, ``__setstate__`` state, dict items, list items) is kept; nothing runs. ``ref`` names the class."""

    ref = "?"

    def __new__(cls, *args: Any, **kw: Any) -> Opaque:
        obj = dict.__new__(cls)
        obj.args, obj.kwargs, obj.state, obj.items_ = args, kw, None, []
        return obj

    def __init__(self, *args: Any, **kw: Any) -> None:  # the constructor runs nothing
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def append(self, x: Any) -> None:
        self.items_.append(x)

    def extend(self, xs: Any) -> None:
        self.items_.extend(xs)

    def __reduce__(self) -> Any:  # never re-pickled as the class it stands for
        return (dict, (dict(self),))

    def __repr__(self) -> str:
        return f"<{self.ref}>"


_OPAQUE: dict[str, type[Opaque]] = {}


def _opaque(module: str, name: str) -> type[Opaque]:
    ref = f"{module}.{name}"
    if ref not in _OPAQUE:
        _OPAQUE[ref] = types.new_class(name, (Opaque,), {}, lambda ns: ns.update(ref=ref))
    return _OPAQUE[ref]


def _reconstructor(cls: Any, base: Any, state: Any = None) -> Any:
    """``copyreg._reconstructor`` for the stand-ins only (the real one would call ``base.__new__`` /
    ``base.__init__`` of the file's choosing)."""
    if isinstance(cls, type) and issubclass(cls, Opaque):
        return cls(state)
    raise UnsafePickleError(f"copyreg._reconstructor of {cls!r}")


class _NdarrayName:
    """What a pickle gets for ``numpy.ndarray``: only an argument of ``_reconstruct`` (called, ``ndarray(shape)``
    would allocate an array of a size the file names)."""

    def __call__(self, *args: Any, **kw: Any) -> Any:
        raise UnsafePickleError(f"numpy.ndarray(...) ({ALLOCATES})")


_NDARRAY = _NdarrayName()

PLAIN_KINDS = "biufc"
"""numpy dtype kinds read from a pickle: booleans, signed and unsigned integers, floats, complex numbers."""
MAX_ITEMSIZE = 32
_TYPE_CODE = re.compile(r"[<>|=]?(?:[biufc]\d{1,2}|[?bBhHiIlLqQpPeEfdgFDG])")


def _plain_dtype(spec: Any) -> np.dtype:
    """The numpy dtype ``spec`` (a type code, a checked ``_Dtype`` or a plain numpy dtype) names, or
    UnsafePickleError: only plain number types of at most ``MAX_ITEMSIZE`` bytes."""
    if isinstance(spec, _Dtype):
        return spec.dtype
    if isinstance(spec, bytes):
        spec = spec.decode("latin-1")
    if isinstance(spec, str) and _TYPE_CODE.fullmatch(spec):
        dtype = np.dtype(spec)
    elif isinstance(spec, np.dtype):
        dtype = spec
    else:
        raise UnsafePickleError(f"numpy dtype {ascii(spec)[:40]} ({NOT_PLAIN})")
    if dtype.kind not in PLAIN_KINDS or dtype.itemsize > MAX_ITEMSIZE or dtype.fields is not None \
            or dtype.subdtype is not None:
        raise UnsafePickleError(f"numpy dtype {str(dtype)[:40]} ({NOT_PLAIN})")
    return dtype


class _Dtype:
    """What a pickle gets for ``numpy.dtype(code, align, copy)``: the code checked (``_plain_dtype``) and the byte
    order its state names; numpy's own ``dtype.__setstate__``, which can make any dtype of any one, never runs."""

    def __init__(self, code: Any, align: Any = False, copy: Any = False) -> None:
        self.dtype = _plain_dtype(code)

    def __setstate__(self, state: Any) -> None:
        # numpy's state: (version, byte order, subarray, names, fields, itemsize, alignment, flags)
        if not isinstance(state, tuple) or len(state) < 2 or any(v is not None for v in state[2:5]):
            raise UnsafePickleError(f"numpy dtype state with a subarray or fields ({NOT_PLAIN})")
        order = state[1].decode("latin-1") if isinstance(state[1], bytes) else state[1]
        if order in ("<", ">"):
            self.dtype = self.dtype.newbyteorder(order)
        elif order not in ("|", "="):
            raise UnsafePickleError(f"numpy dtype byte order {ascii(order)[:20]} ({NOT_PLAIN})")

    def __repr__(self) -> str:
        return f"dtype('{self.dtype}')"


class _PickledArray(np.ndarray):
    """The array numpy's ``_reconstruct`` placeholder becomes: its state is checked before numpy reads it."""

    def __setstate__(self, state: Any) -> None:
        # numpy's state: ([version,] shape, dtype, is_fortran, raw data)
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise UnsafePickleError(f"numpy array state of an unknown form ({NOT_PLAIN})")
        shape, dtype, fortran, raw = state[-4:]
        dtype = _plain_dtype(dtype)
        if not isinstance(shape, tuple) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise UnsafePickleError(f"numpy array shape {str(shape)[:40]} ({NOT_PLAIN})")
        need = math.prod(shape) * dtype.itemsize
        if not isinstance(raw, bytes) or len(raw) != need:
            got = f"{len(raw):,} bytes" if isinstance(raw, bytes) else f"a {type(raw).__name__}"
            raise UnsafePickleError(f"numpy array of shape {str(shape)[:40]} with {got} of data for {need:,} "
                                    f"({ALLOCATES})")
        super().__setstate__((*state[:-4], shape, dtype, bool(fortran), raw))


def _array(reconstruct: Any) -> Any:
    """numpy's ``_reconstruct`` for the placeholder numpy pickles (``ndarray``, shape ``(0,)``; the data come with
    the state): any other shape would allocate an array of a size the file names."""
    def build(subtype: Any, shape: Any, dtype: Any) -> Any:
        if subtype is not _NDARRAY or not isinstance(shape, tuple) or shape != (0,):
            what = "ndarray" if subtype is _NDARRAY else "another type"
            raise UnsafePickleError(f"numpy _reconstruct of {what} with shape {str(shape)[:40]} ({ALLOCATES}: numpy "
                                    "pickles an empty ndarray placeholder, then its data)")
        return reconstruct(_PickledArray, shape, _plain_dtype(dtype))

    return build


def _scalar(found: Any) -> Any:
    """numpy's ``scalar(dtype, data)`` for a plain dtype and data of exactly its size (``scalar(dtype('V1073741824'),
    b'x')`` would allocate a gigabyte first)."""
    def build(dtype: Any, data: Any = None) -> Any:
        dt = _plain_dtype(dtype)
        if not isinstance(data, bytes) or len(data) != dt.itemsize:
            raise UnsafePickleError(f"numpy scalar of {dt} without {dt.itemsize} bytes of data ({ALLOCATES})")
        return found(dt, data)

    return build


def compat_name(module: str, name: str) -> tuple[str, str]:
    """``module.name`` as pickle reads a Python 2 name (``_compat_pickle``: ``commands.Popen`` ->
    ``subprocess.Popen``, ``__builtin__.long`` -> ``builtins.int``)."""
    return python2_name(module, name)


def resolve_global(module: str, name: str) -> Any:
    """What the restricted unpickler hands the pickle for ``module.name`` (after pickle's Python 2 name mapping);
    raises UnsafePickleError."""
    module, name = compat_name(module, name)
    if (module, name) in ALLOWED:
        return ALLOWED[(module, name)]
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    if (module, name) in _NUMPY:
        if name == "ndarray":
            return _NDARRAY
        if name == "dtype":
            return _Dtype
        found = _np(module, name)
        return _array(found) if name == "_reconstruct" else _scalar(found)
    if (module, name) == ("copyreg", "_reconstructor"):
        return _reconstructor
    if not all(part.isidentifier() for part in f"{module}.{name}".split(".")):  # bytes, not a name: a broken file
        raise UnreadablePickleError(f"it names {ascii(f'{module}.{name}')[:80]}, which is no Python name")
    root = module.split(".")[0]
    if root not in DENIED_MODULES and name[:1].isupper() and name.isidentifier():
        return _opaque(module, name)
    raise UnsafePickleError(f"{module}.{name}")


def _storage_bytes(saved_id: Any) -> tuple[Any, int] | None:
    """``(key, bytes)`` a ``torch.save`` storage reference declares (``('storage', type, key, location, numel[,
    view])``), or None for anything else (torch itself refuses what it cannot read)."""
    if not isinstance(saved_id, tuple) or len(saved_id) < 5 or saved_id[0] not in ("storage", b"storage"):
        return None
    key, numel = saved_id[2], saved_id[4]
    try:
        size = saved_id[1].dtype.itemsize
    except (AttributeError, TypeError, RuntimeError):
        return None
    return (key, numel * size) if isinstance(numel, int) else None


class RestrictedUnpickler(pickle.Unpickler):
    """``resolve_global`` for every name; the storages the file references may not declare more than
    ``max_storage_bytes`` together (a storage is allocated at its declared size before its data are read)."""

    max_storage_bytes: int | None = None

    def find_class(self, module: str, name: str) -> Any:
        return resolve_global(module, name)

    @property
    def persistent_load(self) -> Any:  # type: ignore[override]
        return pickle.Unpickler.persistent_load.__get__(self)  # type: ignore[attr-defined]

    @persistent_load.setter
    def persistent_load(self, load: Any) -> None:
        """torch.load's storage loader, behind a count of the bytes the storages declare."""
        declared: dict[Any, int] = {}
        limit = self.max_storage_bytes

        def bounded(saved_id: Any) -> Any:
            found = _storage_bytes(saved_id) if limit is not None else None
            if found is not None:
                declared[found[0]] = found[1]
                if sum(declared.values()) > limit:
                    raise UnsafePickleError(f"tensor storages of {sum(declared.values()):,} bytes in a file of "
                                            f"{limit:,} ({ALLOCATES})")
            return load(saved_id)

        pickle.Unpickler.persistent_load.__set__(self, bounded)  # type: ignore[attr-defined]


def restricted_module(max_storage_bytes: int | None = None) -> types.SimpleNamespace:
    """What ``torch.load(pickle_module=...)`` needs of a pickle module: the restricted unpickler, its storages
    bounded by ``max_storage_bytes`` (the file's size)."""
    unpickler = type("RestrictedUnpickler", (RestrictedUnpickler,), {"max_storage_bytes": max_storage_bytes})
    return types.SimpleNamespace(__name__=__name__, Unpickler=unpickler,
                                 load=lambda f, **kw: unpickler(f, **kw).load())


restricted = restricted_module()


def _check_zip_sizes(path: str | os.PathLike) -> None:
    """A zip (``torch.save``'s format, records stored uncompressed) whose records declare far more bytes than the
    file holds is refused before a record is inflated: a compressed record of a stated size is allocated whole."""
    try:
        if not zipfile.is_zipfile(path):
            return
        with zipfile.ZipFile(path) as z:
            declared = sum(i.file_size for i in z.infolist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return  # torch.load reports what is wrong with it
    size = os.path.getsize(path)
    if declared > 4 * size + (1 << 20):
        raise UnsafePickleError(f"records of {declared:,} bytes in a file of {size:,} ({ALLOCATES}: a compressed "
                                "record, which torch.save does not write)")


def load_pickled(path: str | os.PathLike) -> Any:
    """The contents of a ``torch.save`` file (zip or legacy) on the CPU, through the restricted unpickler.

    Raises UnsafePickleError (one line naming the file and the refused callable) when the file names code, and
    UnreadablePickleError (one line) when it is not a readable ``torch.save`` file (empty, truncated, corrupt)."""
    try:
        _check_zip_sizes(path)
        return torch.load(str(path), map_location="cpu", weights_only=False,
                          pickle_module=restricted_module(os.path.getsize(path)))
    except UnsafePickleError as e:
        if ALLOCATES in str(e):
            raise UnsafePickleError(f"{path} holds {e}: refused before anything was allocated") from None
        if NOT_PLAIN in str(e):
            raise UnsafePickleError(f"{path} holds {e}: refused before numpy read it (numpy builds its objects in "
                                    "native code)") from None
        raise UnsafePickleError(
            f"{path} names {e}, which loading would call (code, not data): refused; only tensors and the "
            "references' containers are read from a pickle (use the model's safetensors if it has them)") from None
    except MemoryError:
        raise UnreadablePickleError(f"{path}: reading it ran out of memory (a corrupt or hostile file)") from None
    except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, TypeError, AttributeError, KeyError,
            IndexError, OverflowError, UnicodeDecodeError, zipfile.BadZipFile) as e:
        what = "empty" if os.path.getsize(path) == 0 else "truncated or corrupt"
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise UnreadablePickleError(f"{path} is not a readable torch.save checkpoint ({what}: {first}); download "
                                    "it again or pass the model's folder") from None


MAX_DEPTH = 100
"""Levels of nesting a hyper-parameter tree may have (the references' configs have a handful)."""


def plain(obj: Any, _seen: frozenset[int] = frozenset(), _depth: int = 0) -> Any:
    """Plain data (dicts, lists, scalars, strings) of a loaded hyper-parameter tree: OmegaConf containers and
    nodes and Lightning's ``AttributeDict`` by their content; any other stand-in as ``'<module.Class>'``;
    tensors left out (``'<tensor>'``). UnreadablePickleError past ``MAX_DEPTH`` levels."""
    if _depth > MAX_DEPTH:
        raise UnreadablePickleError(f"its hyper-parameters are nested deeper than {MAX_DEPTH} levels: not a "
                                    "checkpoint of the references")
    if id(obj) in _seen:
        return "<cycle>"
    seen = _seen | {id(obj)}

    def sub(v: Any) -> Any:
        return plain(v, seen, _depth + 1)

    if isinstance(obj, Opaque):
        ref = obj.ref
        state = obj.state if isinstance(obj.state, dict) else {}
        if ref.endswith(".DictConfig"):
            content = state.get("_content")
            return sub(content) if isinstance(content, dict) or content else {}
        if ref.endswith(".ListConfig"):
            content = state.get("_content")
            return [sub(v) for v in content] if isinstance(content, list) else sub(content)
        if ref.startswith("omegaconf.nodes."):
            return sub(state.get("_val"))
        if ref.endswith("AttributeDict"):
            return {str(k): sub(v) for k, v in dict.items(obj)}
        if ref == "argparse.Namespace":  # older Lightning hyper-parameters: its attributes are its state
            return sub(state)
        return f"<{ref}>"
    if isinstance(obj, dict):
        return {str(k): sub(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sub(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return "<tensor>"
    if isinstance(obj, np.ndarray):
        return "<ndarray>"
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, _Dtype):
        return str(obj.dtype)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return f"<{type(obj).__name__}>"


__all__ = ["MAX_DEPTH", "Opaque", "UnreadablePickleError", "UnsafePickleError", "compat_name", "load_pickled", "plain",
           "resolve_global", "restricted_module"]
