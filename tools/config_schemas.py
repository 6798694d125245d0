"""The JSON Schema of every YAML kind, generated from the config dataclasses through ``pipelines.core.configlib`` and
committed under ``schemas/`` so that an editor validates ``configs/*.yaml``, ``tune_spaces/*.yaml`` and
``studies/*.yaml`` as you type (docs/usage/configs.md); ``tests/pipelines/test_configlib.py`` fails when one is
out of date.

    python tools/config_schemas.py --write-schemas     # regenerate after changing a config field
    python tools/config_schemas.py --check-schemas     # exit 1 when a committed schema is out of date

Its own module, not part of ``configlib``: the kinds it describes (``TrainConfig``, ``SpaceFile``,
``StudyFile``) are parsed by ``configlib``, so generating their schemas there would be an import circle.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository first

from adlm_model.config import PRESETS
from pipelines.core.cli import run_command
from pipelines.core.configlib import adapter
from pipelines.studies.spec import StudyFile
from pipelines.training.config import TrainConfig
from pipelines.tuning.space import SpaceFile

SCHEMA_DIR = Path(__file__).resolve().parents[1] / "schemas"


def _schema(ann: Any, title: str, description: str) -> dict[str, Any]:
    body = adapter(ann).json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **body, "title": title,
            "description": description}


def schemas() -> dict[str, dict[str, Any]]:
    """The JSON Schema of every YAML kind, by file stem: ``recipe`` (configs/*.yaml), ``search_space``
    (tune_spaces/*.yaml), ``study`` (studies/*.yaml)."""
    recipe = _schema(TrainConfig, "ADLM training recipe", "A training recipe (configs/*.yaml); every section and "
                     "key is optional and falls back to the reference recipe (pipelines/training/config.py).")
    model = recipe["$defs"]["ModelConfig"]
    # `preset` is no ModelConfig field: the recipe's model section starts from it (build_model_config).
    model["properties"] = {"preset": {"enum": list(PRESETS), "description": "Start from this preset "
                                      "(adlm_model.config.PRESETS); the other keys override its fields."},
                           **model["properties"]}
    return {
        "recipe": recipe,
        "search_space": _schema(SpaceFile, "ADLM search space", "A gamma/tau sweep (tune_spaces/*.yaml; "
                                "pipelines/tuning/space.py)."),
        "study": _schema(StudyFile, "ADLM study", "A study: arms, seeds and budgets (studies/*.yaml; "
                         "pipelines/studies/spec.py)."),
    }


def schema_text(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2) + "\n"


def write_schemas(out: Path = SCHEMA_DIR) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, schema in schemas().items():
        p = out / f"{name}.schema.json"
        p.write_text(schema_text(schema))
        written.append(p)
    return written


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python tools/config_schemas.py",
                                 description="Write or check the JSON Schemas of the config files "
                                             "(schemas/*.schema.json), generated from the config dataclasses.")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write-schemas", action="store_true", help=f"write {SCHEMA_DIR.name}/*.schema.json")
    g.add_argument("--check-schemas", action="store_true", help="exit 1 when a committed schema is out of date")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(build_parser(), _run, argv, environment=False)


def _run(args: argparse.Namespace) -> int:
    if args.write_schemas:
        for p in write_schemas():
            print(p)
        return 0
    stale = [n for n, s in schemas().items()
             if not (SCHEMA_DIR / f"{n}.schema.json").is_file()
             or (SCHEMA_DIR / f"{n}.schema.json").read_text() != schema_text(s)]
    if stale:
        print(f"schemas out of date: {', '.join(stale)}; run python tools/config_schemas.py --write-schemas",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
