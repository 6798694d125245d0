"""``--set KEY=VALUE``: the one parser and the one typed coercion every CLI uses.

- Recipes (training, tuning): ``section.key=VALUE`` assignments go into the raw YAML mapping
  (``set_nested``; the value is parsed as YAML), then each section's dataclass takes its fields through
  ``coerce_fields`` (YAML gives ``3e-4`` as a string and ``1`` for a float field).
- Flat settings (evaluation, promotion, generation): ``apply_to`` sets ``KEY=VALUE`` on the first
  dataclass that has the field, through the same ``coerce``.

Every failure is a ``ConfigError`` (a ``ValueError``) of one line naming the key and what it expects.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from adlm_model.config import ConfigError

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def read_yaml_file(path: str | os.PathLike, what: str, choices: str) -> Any:
    """The parsed YAML of a recipe, search space or study file; a one-line ConfigError naming ``what`` and
    where to find valid ones (``choices``, e.g. ``configs/*.yaml``) when it is missing or not YAML."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {p} does not exist; pass one of {choices}")
    try:
        return yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {p} is not valid YAML: {str(e).splitlines()[0]}") from None


def split_assignment(assignment: str) -> tuple[list[str], str]:
    """``"a.b=3"`` -> (["a", "b"], "3"); one-line error for anything else."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r} must look like KEY=VALUE (e.g. run.max_steps=100)")
    key, value = assignment.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"--set {assignment!r} has an empty key")
    return parts, value.strip()


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin in (tuple, list):
        return "comma list"
    return getattr(annotation, "__name__", str(annotation))


def coerce(value: Any, annotation: Any, where: str) -> Any:
    """``value`` (a string from the command line, or what YAML gave) as the declared type.

    Numbers accept strings (``3e-4``); ints refuse fractions; bools accept true/false/yes/no/on/off/1/0;
    lists and tuples accept YAML lists or comma-separated strings; ``X | None`` accepts ``none``/``null``.
    """
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    try:
        if origin in (typing.Union, getattr(__import__("types"), "UnionType", ())):
            if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
                if type(None) in args:
                    return None
            last: Exception | None = None
            for a in args:
                if a is type(None):
                    continue
                try:
                    return coerce(value, a, where)
                except ConfigError as e:
                    last = e
            raise last or ValueError(value)
        if annotation is bool:
            if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
                return value.lower() in _TRUE
            if isinstance(value, bool):
                return value
            raise ValueError(value)
        if annotation is int:
            if isinstance(value, bool):
                raise ValueError(value)
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(float(value)) if isinstance(value, str) and "." in value else int(value)
        if annotation is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if annotation is str:
            return str(value)
        if origin in (list, tuple):
            items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else list(value)
            inner = args[0] if args else str
            out = [coerce(v, inner, where) for v in items]
            return tuple(out) if origin is tuple else out
        if origin is dict or annotation is dict:
            if not isinstance(value, dict):
                raise ValueError(value)
            return dict(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}={value!r}: expected {_type_name(annotation)}") from None
    return value


def coerce_fields(cls: type, d: dict[str, Any], where: str) -> dict[str, Any]:
    """Every value of ``d`` as the type its field of dataclass ``cls`` declares; unknown keys refused."""
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ConfigError(f"unknown {where} config key(s) {', '.join(unknown)}; known keys: {', '.join(known)}")
    return {k: coerce(v, hints[k], f"{where}.{k}") for k, v in d.items()}


def set_nested(raw: dict[str, Any], assignment: str, sections: Sequence[str]) -> None:
    """Apply one ``section.key=VALUE`` (VALUE parsed as YAML) to a raw recipe mapping in place."""
    parts, value = split_assignment(assignment)
    if parts[0] not in sections:
        raise ConfigError(f"--set {assignment!r}: unknown section {parts[0]!r}; known: {', '.join(sections)}")
    node = raw
    for p in parts[:-1]:
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {assignment!r}: {p!r} is not a section")
        node = nxt
    node[parts[-1]] = yaml.safe_load(value) if value else ""


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
            getattr(target, field)[parts[1]] = yaml.safe_load(value) if value else ""
            continue
        for cfg in configs:
            hints = typing.get_type_hints(type(cfg))
            if key in hints and key not in reserved and key not in dict_prefixes.values():
                setattr(cfg, key, coerce(value, hints[key], f"--set {key}"))
                break
        else:
            known = sorted({f.name for c in configs for f in dataclasses.fields(c)} - set(reserved)
                           - set(dict_prefixes.values()))
            extra = ", ".join(f"{p}.OPTION" for p in dict_prefixes)
            raise ConfigError(f"unknown setting {key!r}; known: {', '.join(known)}" + (f", {extra}" if extra else ""))


def settings_help(cls: type, title: str) -> str:
    """``--help`` text for the ``--set`` keys of a settings dataclass: each field with its default and the
    docstring written under it in the class's source (the one place they are documented)."""
    import ast
    import inspect

    docs: dict[str, str] = {}
    body = ast.parse(inspect.getsource(cls)).body[0].body
    for a, b in zip(body, body[1:], strict=False):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = " ".join(str(b.value.value).split())
    lines = [f"{title}:"]
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        shown = ",".join(default) if isinstance(default, tuple) else default
        lines.append(f"  {f.name} (default {shown!s}): {docs.get(f.name, '')}")
    return "\n".join(lines)
