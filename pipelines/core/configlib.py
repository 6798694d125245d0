"""One typed config library: recipes, search spaces, studies, evaluation settings and ``--set`` values.

Every config kind is a plain dataclass (``ModelConfig``, the ``TrainConfig`` sections, ``EvalConfig``, the
file shapes ``SpaceFile`` and ``StudyFile``) whose field docstrings document it. This module is the one place
that turns YAML or command-line text into those dataclasses:

- unknown keys are refused by ``adlm_model.config.refuse_unknown`` (one line, with a did-you-mean), walked over
  nested sections by :func:`check_tree`;
- values are coerced and type-checked by pydantic (``TypeAdapter`` over the SAME dataclasses, so the objects
  loaded are the dataclasses themselves), after :func:`_prepare` has applied the command-line conventions
  pydantic lacks (comma lists, ``none``); a type error is one line naming the key and the type it expects;
- field docstrings become field descriptions (``use_attribute_docstrings``): the ``--set`` help text and the
  committed JSON Schemas (``schemas/*.schema.json``, ``tools/config_schemas.py``) read them.

Each kind's own semantic rules (ranges, names, cross-field checks) stay with the kind (``validate()`` methods,
``parse_space``, ``parse_study``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import textwrap
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError, with_config

from adlm_model.config import ConfigError, refuse_unknown
from pipelines.core.pydantic_config import PYDANTIC_CONFIG

__all__ = ["ConfigError", "refuse_unknown", "check_tree", "validate", "coerce", "coerce_fields", "read_yaml_file",
           "load_yaml", "check_finite", "split_assignment", "set_nested", "apply_to", "descriptions", "settings_help",
           "adapter", "ConfigKey", "config_keys", "keys_help", "type_text"]

_NONE = ("none", "null")


# ----------------------------------------------------------------------------------------------------------
# Types.


def _is_union(ann: Any) -> bool:
    return typing.get_origin(ann) in (typing.Union, types.UnionType)


def _optional_inner(ann: Any) -> Any:
    """``X`` for ``X | None`` (and any union with one non-None member), else ``ann``."""
    if _is_union(ann):
        rest = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return ann


def _takes_none(ann: Any) -> bool:
    return ann is Any or (_is_union(ann) and type(None) in typing.get_args(ann))


def _type_name(ann: Any) -> str:
    if typing.get_origin(ann) in (tuple, list):
        return "comma list"
    if _is_union(ann):
        return " or ".join("none" if a is type(None) else _type_name(a) for a in typing.get_args(ann))
    return getattr(ann, "__name__", str(ann))


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _register(ann: Any, seen: set[int] | None = None) -> None:
    """Give every dataclass reachable from ``ann`` the library's pydantic config (pydantic reads it per class)."""
    seen = set() if seen is None else seen
    if id(ann) in seen:
        return
    seen.add(id(ann))
    if dataclasses.is_dataclass(ann) and isinstance(ann, type):
        if "__pydantic_config__" not in vars(ann):
            with_config(PYDANTIC_CONFIG)(ann)
        for h in _hints(ann).values():
            _register(h, seen)
    for a in typing.get_args(ann):
        _register(a, seen)


@functools.cache
def adapter(ann: Any) -> TypeAdapter:
    """The pydantic validator of a type (cached: building one costs milliseconds)."""
    _register(ann)
    return TypeAdapter(ann)


# ----------------------------------------------------------------------------------------------------------
# Checking and coercion.


def _join(where: str, path: str, sep: str) -> str:
    """``optim`` + ``lr`` -> ``optim.lr`` (``sep`` "."); a file's label + a key in it (``sep`` ": ") ->
    ``search space x.yaml: params.gamma``."""
    return f"{where}{sep}{path}" if path else where


def check_tree(ann: Any, data: Any, where: str, sep: str = ".", _path: str = "") -> None:
    """Refuse unknown keys at every level of ``data`` that the type ``ann`` describes as a dataclass."""
    ann = _optional_inner(ann)
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    dot = f"{_path}." if _path else ""
    if dataclasses.is_dataclass(ann) and isinstance(data, dict):
        hints = _hints(ann)
        refuse_unknown(data, [f.name for f in dataclasses.fields(ann)], _join(where, _path, sep))
        for k, v in data.items():
            check_tree(hints[k], v, where, sep, f"{dot}{k}")
    elif origin is dict and len(args) == 2 and isinstance(data, dict):
        for k, v in data.items():
            check_tree(args[1], v, where, sep, f"{dot}{k}")
    elif origin in (list, tuple) and args and isinstance(data, list):
        for i, v in enumerate(data):
            check_tree(args[0], v, where, sep, f"{_path}[{i}]")


def _prepare(ann: Any, value: Any) -> Any:
    """The command-line conventions pydantic does not have: ``none``/``null`` for ``X | None``, comma-separated
    text for lists and tuples, and booleans given for a text field read as text (as the old coercion did)."""
    if _is_union(ann) and type(None) in typing.get_args(ann):
        if value is None or (isinstance(value, str) and value.lower() in _NONE):
            return None
    ann = _optional_inner(ann)
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is str and isinstance(value, bool):
        return str(value)
    if origin in (list, tuple) and isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if dataclasses.is_dataclass(ann) and isinstance(value, dict):
        hints = _hints(ann)
        defaulted = {f.name for f in dataclasses.fields(ann)
                     if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
        # An empty YAML key (``overrides:`` with every line commented out) of a field that takes no None: its default.
        return {k: _prepare(hints[k], v) if k in hints else v for k, v in value.items()
                if not (v is None and k in defaulted and not _takes_none(hints[k]))}
    if origin is dict and len(args) == 2 and isinstance(value, dict):
        return {k: _prepare(args[1], v) for k, v in value.items()}
    if origin in (list, tuple) and args and isinstance(value, (list, tuple)):
        inner = args[0]
        return [_prepare(inner, v) for v in value]
    return value


def _short(x: Any) -> str:
    r = repr(x)
    return r if len(r) <= 80 else r[:77] + "..."


def _one_line(err: ValidationError, ann: Any, where: str, sep: str) -> str:
    """The first error of a pydantic validation as one line: the dotted key, the value, what it expects."""
    e = err.errors(include_url=False)[0]
    path: list[str] = []
    for part in e["loc"]:
        inner = _optional_inner(ann)
        origin, args = typing.get_origin(inner), typing.get_args(inner)
        if isinstance(part, str) and dataclasses.is_dataclass(inner) and part in _hints(inner):
            ann = _hints(inner)[part]
            path.append(f".{part}")
        elif origin is dict and len(args) == 2 and isinstance(part, str):
            ann = args[1]
            path.append(f".{part}")
        elif isinstance(part, int) and origin in (list, tuple) and args:
            ann = args[0]
            path.append(f"[{part}]")
        else:  # a pydantic-internal step (a union member's tag): the annotation reached so far names the type
            break
    dotted = "".join(path).lstrip(".")
    key = _join(where, dotted, sep)
    if e["type"] == "missing":
        return f"{where}: missing required key {dotted!r}"
    if e["type"] in ("dict_type", "model_type", "dataclass_type", "dataclass_args_type") and dataclasses.is_dataclass(
            _optional_inner(ann)):
        return f"{key} must be a mapping of keys to values, got {_short(e['input'])}"
    return f"{key}={_short(e['input'])}: expected {_type_name(ann)}"


def validate(ann: Any, data: Any, where: str, sep: str = ".") -> Any:
    """``data`` (from YAML or the command line) as the type ``ann`` (a config dataclass, or any type); a
    one-line ConfigError naming the key otherwise. Unknown keys are refused before any value is read.

    ``where`` names the whole (``optim``, a recipe's section, or ``search space x.yaml``, a file); ``sep`` joins
    it to a key's path inside (``.``: ``optim.lr``; ``": "``: ``search space x.yaml: params.gamma``)."""
    check_tree(ann, data, where, sep)
    try:
        out = adapter(ann).validate_python(_prepare(ann, data))
    except ValidationError as e:
        raise ConfigError(_one_line(e, ann, where, sep)) from None
    check_finite(out, where, sep)
    return out


def _inf_default(cls: type, name: str) -> bool:
    """Whether field ``name`` of dataclass ``cls`` defaults to an infinity (``inf``: no threshold), which its
    value may then be too."""
    f = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    return f is not None and isinstance(f.default, float) and math.isinf(f.default)


def check_finite(value: Any, where: str, sep: str = ".", _path: str = "", inf_ok: bool = False) -> None:
    """Refuse a NaN anywhere in a validated config, and an infinity except in a field whose default is one
    (``stage1_max_ppl: inf``: no threshold): ``optim.lr=.inf`` would train on NaN losses from the first step."""
    if isinstance(value, float) and not math.isfinite(value) and not (inf_ok and math.isinf(value)):
        raise ConfigError(f"{_join(where, _path, sep)}={value}: expected a finite number")
    dot = f"{_path}." if _path else ""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            check_finite(getattr(value, f.name), where, sep, f"{dot}{f.name}", _inf_default(type(value), f.name))
    elif isinstance(value, dict):
        for k, v in value.items():
            check_finite(v, where, sep, f"{dot}{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_finite(v, where, sep, f"{_path}[{i}]")


def coerce(value: Any, annotation: Any, where: str, inf_ok: bool = False) -> Any:
    """``value`` (text from the command line, or what YAML gave) as the declared type.

    Numbers accept text (``3e-4``); ints refuse fractions; bools accept true/false/yes/no/on/off/1/0; lists and
    tuples accept YAML lists or comma-separated text; ``X | None`` accepts ``none``/``null``.
    """
    try:
        out = adapter(annotation).validate_python(_prepare(annotation, value))
    except ValidationError:
        raise ConfigError(f"{where}={_short(value)}: expected {_type_name(annotation)}") from None
    check_finite(out, where, inf_ok=inf_ok)
    return out


def coerce_fields(cls: type, d: dict[str, Any], where: str) -> dict[str, Any]:
    """Every value of ``d`` as the type its field of dataclass ``cls`` declares; unknown keys refused."""
    refuse_unknown(d, [f.name for f in dataclasses.fields(cls)], where)
    hints = _hints(cls)
    return {k: coerce(v, hints[k], f"{where}.{k}", _inf_default(cls, k)) for k, v in d.items()}


# ----------------------------------------------------------------------------------------------------------
# Files and --set.


def read_yaml_file(path: str | os.PathLike, what: str, choices: str) -> Any:
    """The parsed YAML of a recipe, search space or study file; a one-line ConfigError naming ``what`` and
    where to find valid ones (``choices``, e.g. ``configs/*.yaml``) when it is missing or not YAML."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {p} does not exist; pass one of {choices}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {p} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    return load_yaml(text, f"{what} {p}")


def load_yaml(text: str, what: str) -> Any:
    """``text`` parsed as YAML (safe: no ``!!python`` tags), or a one-line ConfigError naming ``what`` and the
    problem's first line."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
        said = f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if problem and mark else str(e)
        said = " ".join(said.split())[:200]
        if isinstance(e, yaml.constructor.ConstructorError):
            said += "; tags such as !!python are not read: write plain values"
        elif any(c in text for c in "{}[]:#&*!|>'\"%@`"):
            said += "; quote a text value that holds YAML's special characters"
        raise ConfigError(f"{what} is not valid YAML: {said}") from None


def split_assignment(assignment: str) -> tuple[list[str], str]:
    """``"a.b=3"`` -> (["a", "b"], "3"); one-line error for anything else."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r} must look like KEY=VALUE (e.g. run.max_steps=100)")
    key, value = assignment.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"--set {assignment!r} has an empty key")
    return parts, value.strip()


def set_nested(raw: dict[str, Any], assignment: str, sections: Sequence[str]) -> None:
    """Apply one ``section.key=VALUE`` (VALUE parsed as YAML) to a raw recipe mapping in place."""
    parts, value = split_assignment(assignment)
    refuse_unknown(parts[:1], sections, f"--set {assignment!r}")
    node = raw
    for p in parts[:-1]:
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {assignment!r}: {p!r} is not a section")
        node = nxt
    node[parts[-1]] = load_yaml(value, f"--set {assignment!r}: the value") if value else ""


def apply_to(configs: Sequence[Any], assignments: Sequence[str], *, dict_prefixes: dict[str, str] | None = None,
             reserved: Sequence[str] = ()) -> None:
    """Apply flat ``KEY=VALUE`` assignments to the first dataclass in ``configs`` that has the field.

    ``dict_prefixes`` maps a key prefix to a dict field (``{"sampler": "sampler_kwargs"}``:
    ``sampler.eta=0.02`` goes into ``sampler_kwargs["eta"]``, its value parsed as YAML). ``reserved``
    fields cannot be set directly. Unknown keys fail listing the known ones.
    """
    dict_prefixes = dict_prefixes or {}
    for assignment in assignments:
        parts, value = split_assignment(assignment)
        key = ".".join(parts)
        if len(parts) == 2 and parts[0] in dict_prefixes:
            field = dict_prefixes[parts[0]]
            target = next((c for c in configs if hasattr(c, field)), None)
            if target is None:
                raise ConfigError(f"--set {key}: no {parts[0]} options here")
            getattr(target, field)[parts[1]] = load_yaml(value, f"--set {assignment!r}: the value") if value else ""
            continue
        for cfg in configs:
            hints = _hints(type(cfg))
            if key in hints and key not in reserved and key not in dict_prefixes.values():
                setattr(cfg, key, coerce(value, hints[key], f"--set {key}", _inf_default(type(cfg), key)))
                break
        else:
            known = sorted({f.name for c in configs for f in dataclasses.fields(c)} - set(reserved)
                           - set(dict_prefixes.values()))
            refuse_unknown([key], known + [f"{p}.OPTION" for p in dict_prefixes], "--set")


# ----------------------------------------------------------------------------------------------------------
# Descriptions, help and schemas.


def descriptions(cls: type) -> dict[str, str]:
    """Field name -> its docstring (the text under the field in the class), whitespace collapsed."""
    schema = adapter(cls).json_schema()
    props = schema.get("properties") or schema["$defs"][cls.__name__]["properties"]
    return {k: " ".join(str(v.get("description", "")).split()) for k, v in props.items()}


def settings_help(cls: type, title: str) -> str:
    """``--help`` text for the ``--set`` keys of a settings dataclass: each field with its default and its
    docstring (the one place they are documented)."""
    docs = descriptions(cls)
    lines = [f"{title}:"]
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        shown = ",".join(default) if isinstance(default, tuple) else default
        lines.append(f"  {f.name} (default {shown!s}): {docs.get(f.name, '')}")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    """One key of a config file or ``--set``: its dotted name, type, default and description (the field's
    docstring). What ``pipelines.train --help-config`` prints and the config reference page lists."""

    name: str
    type: str
    default: str
    description: str


def type_text(ann: Any) -> str:
    """A field's type in words: ``float``, ``int or none``, ``list of float``, ``mapping of str to int``."""
    if typing.get_origin(ann) is typing.Annotated:
        return type_text(typing.get_args(ann)[0])
    if ann is Any:
        return "any"
    if _is_union(ann):
        return " or ".join("none" if a is type(None) else type_text(a) for a in typing.get_args(ann))
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (list, tuple):
        return f"list of {type_text(args[0])}" if args else "list"
    if origin is dict:
        return f"mapping of {type_text(args[0])} to {type_text(args[1])}" if args else "mapping"
    return getattr(ann, "__name__", str(ann))


def _default_text(value: Any) -> str:
    if value is dataclasses.MISSING:
        return "required"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(str, value)) + "]"
    if isinstance(value, str):
        return f'"{value}"' if value else '""'
    return "none" if value is None else str(value)


def _nested(ann: Any) -> tuple[str, type] | None:
    """(suffix, dataclass) when ``ann`` holds dataclasses keyed further: ``X`` (""), ``dict[str, X]`` (".NAME"),
    ``list[X]`` ("[]"), each possibly ``| None``."""
    ann = _optional_inner(ann)
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if dataclasses.is_dataclass(ann) and isinstance(ann, type):
        return "", ann
    if origin is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
        return ".NAME", args[1]
    if origin in (list, tuple) and args and dataclasses.is_dataclass(args[0]):
        return "[]", args[0]
    return None


def config_keys(cls: type, instance: Any = None, prefix: str = "") -> list[ConfigKey]:
    """Every key of the dataclass ``cls``, nested sections walked (``optim.lr``; ``params.NAME.low`` for a mapping
    of sections; ``arms[].name`` for a list), with the defaults of ``instance`` where given (a recipe's sections
    default to what ``TrainConfig()`` holds), else the fields' own."""
    docs = descriptions(cls)
    hints = _hints(cls)
    out: list[ConfigKey] = []
    for f in dataclasses.fields(cls):
        if instance is not None:
            default = getattr(instance, f.name)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = dataclasses.MISSING
        nested = _nested(hints[f.name])
        if nested is not None:
            suffix, inner = nested
            section = default if suffix == "" and dataclasses.is_dataclass(default) else None
            if docs.get(f.name):
                out.append(ConfigKey(f"{prefix}{f.name}", "section", "required" if default is dataclasses.MISSING
                                     else ("none" if default is None else "(its keys)"), docs[f.name]))
            out += config_keys(inner, section, f"{prefix}{f.name}{suffix}.")
            continue
        out.append(ConfigKey(f"{prefix}{f.name}", type_text(hints[f.name]), _default_text(default),
                             docs.get(f.name, "")))
    return out


def keys_help(keys: Sequence[ConfigKey], title: str) -> str:
    """The keys as plain text: one paragraph a key (name, type, default; its description indented below)."""
    lines = [f"{title}:"]
    for k in keys:
        lines.append(f"  {k.name} ({k.type}; default {k.default})")
        if k.description:
            lines += textwrap.wrap(k.description.replace("``", ""), 100, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)
