"""The one config library (pipelines/core/configlib.py): every shipped YAML loads to the values it names over the
declared defaults, unknown keys fail in one line with a did-you-mean, and the committed JSON Schemas are current
and accept every shipped file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from adlm_model.config import PRESETS, ConfigError, ModelConfig
from pipelines.core import configlib
from pipelines.core.configlib import settings_help
from pipelines.data.plan import PrepareConfig
from pipelines.evaluation.config import EvalConfig, apply_overrides
from pipelines.studies.comparisons import Comparison
from pipelines.studies.spec import Arm, load_study, parse_study
from pipelines.training.config import SECTIONS, TrainConfig, load_config
from pipelines.tuning.space import load_space, parse_space
from tools import config_schemas

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "configs").glob("*.yaml"))
SPACES = sorted((ROOT / "tune_spaces").glob("*.yaml"))
STUDIES = sorted((ROOT / "studies").glob("*.yaml"))
KIND_OF = {"configs": "recipe", "tune_spaces": "search_space", "studies": "study"}


def _same(a, b) -> bool:
    """Equal values, lists and tuples alike (YAML has no tuples); floats exactly."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b or (isinstance(b, float) and isinstance(a, int) and float(a) == b)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_loads_to_its_values_over_the_defaults(path: Path) -> None:
    raw = yaml.safe_load(path.read_text()) or {}
    cfg = load_config(path)
    assert type(cfg) is TrainConfig and type(cfg.model) is ModelConfig
    # The model: the preset's fields, the section's over them, ModelConfig's defaults for the rest.
    m = dict(raw.get("model") or {})
    expect = {**{f.name: f.default for f in dataclasses.fields(ModelConfig)}, **PRESETS.get(m.pop("preset", ""), {}),
              **m}
    if expect["gamma_horizon"] == 0:  # the reference's K: the run's length
        expect["gamma_horizon"] = cfg.run.max_steps
    for k, v in expect.items():
        assert _same(v, getattr(cfg.model, k)), (path.name, "model", k, v, getattr(cfg.model, k))
    for name, sec in SECTIONS.items():
        given, got = raw.get(name) or {}, getattr(cfg, name)
        assert type(got) is sec
        for f in dataclasses.fields(sec):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            want = given.get(f.name, default)
            assert _same(want, getattr(got, f.name)), (path.name, name, f.name, want, getattr(got, f.name))
            assert type(getattr(got, f.name)) is type(default), (path.name, name, f.name)
    assert cfg.ema == raw.get("ema", 0.9999) and cfg.ema_warmup == raw.get("ema_warmup", True)


# Known values of the shipped search spaces and studies, as the hand-written parsers loaded them.
SPACE_DEFAULTS = {"search": {"algorithm": "random", "seed": 0},
                  "scheduler": {"type": "asha", "grace_period": 10, "reduction_factor": 2.0, "max_t": None},
                  "num_samples": 4, "max_concurrent": 2, "metric": "val_ppl", "resources": {"trial_cpu": 0.01},
                  "overrides": {}}


@pytest.mark.parametrize("path", SPACES, ids=lambda p: p.name)
def test_every_shipped_space_loads_to_its_values_over_the_defaults(path: Path) -> None:
    raw = yaml.safe_load(path.read_text())
    space = load_space(path)
    expect = {k: {**v, **(raw.get(k) or {})} if isinstance(v, dict) and k != "overrides" else raw.get(k, v)
              for k, v in SPACE_DEFAULTS.items()}
    got = space.to_raw()
    assert got["name"] == raw["name"] and {k: got[k] for k in SPACE_DEFAULTS} == expect
    assert got["params"] == raw["params"]
    assert [p.key for p in space.params] == [{"gamma": "model.gamma", "tau": "model.tau"}.get(k, k)
                                             for k in raw["params"]]
    assert space.source == str(path)


def test_the_shipped_studies_load_to_known_values() -> None:
    assert {p.name for p in STUDIES} == {"laptop.yaml", "testbed.yaml", "testbed_sedd.yaml"}
    tb = load_study(ROOT / "studies" / "testbed.yaml")
    assert (tb.name, tb.config, tb.steps, tb.seeds, tb.data) == (
        "testbed", "configs/testbed_adlm.yaml", 1200, [0, 1, 2, 3, 4], PrepareConfig(source=["testbed"], out="data/testbed"))
    assert (tb.flops_reference, tb.baseline, tb.max_concurrent, tb.trial_cpu, tb.overrides) == (
        "adlm", "mdlm", 2, 0.75, {})
    five, three = [0, 1, 2, 3, 4], [0, 1, 2]
    assert tb.arms == [Arm("adlm", {}, five, True), Arm("mdlm", {"model.kind": "mdlm"}, five, True),
                       Arm("mdlm-params", {"model.kind": "mdlm", "model.n_blocks": 3}, five, True),
                       Arm("adlm-gamma0", {"model.gamma": 0.0}, five, True), Arm("ar", {"model.kind": "ar"}, three, True),
                       Arm("bd3lm", {"model.kind": "bd3lm", "model.block_size": 4}, three, True)]
    assert tb.comparisons == [Comparison("adlm", "adlm-gamma0", "steps", True), Comparison("adlm", "mdlm-params", "flops"),
                              Comparison("adlm", "mdlm", "steps"), Comparison("adlm", "mdlm", "flops")]
    assert tb.hypothesis.startswith("Written and committed before any run")
    sedd = load_study(ROOT / "studies" / "testbed_sedd.yaml")
    assert (sedd.config, sedd.steps, sedd.seeds, sedd.data, sedd.flops_reference, sedd.baseline) == (
        "configs/testbed_sedd.yaml", 1200, five, tb.data, "mdlm", "mdlm")
    assert sedd.arms == [Arm("sedd", {}, five, True), Arm("mdlm", {"model.kind": "mdlm"}, five, True),
                         Arm("mdlm-time", {"model.kind": "mdlm", "model.time_conditioning": True}, three, True)]
    assert sedd.comparisons[0] == Comparison("mdlm", "sedd", "steps", True)
    assert sedd.hypothesis.startswith("Written and committed before any run")
    lap = load_study(ROOT / "studies" / "laptop.yaml")
    raw = yaml.safe_load((ROOT / "studies" / "laptop.yaml").read_text())
    grid = [a for a in lap.arms if a.name not in {x["name"] for x in raw["arms"]}]
    assert len(grid) == len([1 for _ in raw["grid"]["params"]["model.gamma"] for _ in raw["grid"]["params"]["model.tau"]])
    assert all(a.seeds == raw["grid"]["seeds"] and not a.equal_flops for a in grid)
    assert lap.seeds == raw["seeds"] and lap.steps == raw["steps"] and lap.config == raw["config"]


@pytest.mark.parametrize("load, message", [
    (lambda: load_config(ROOT / "configs" / "demo.yaml", ["optim.lrr=1"]),
     "optim: unknown key(s) lrr (did you mean 'lr'?); known: lr, betas"),
    (lambda: load_config(ROOT / "configs" / "demo.yaml", ["modle.kind=mdlm"]),
     "unknown key(s) modle (did you mean 'model'?); known: model, data"),
    (lambda: TrainConfig.from_dict({"scaling": {"num_worker": 1}}),
     "scaling: unknown key(s) num_worker (did you mean 'num_workers'?)"),
    (lambda: ModelConfig.from_dict({"hiden": 3}), "model: unknown key(s) hiden (did you mean 'hidden'?)"),
    (lambda: parse_space({**yaml.safe_load((ROOT / "tune_spaces" / "demo.yaml").read_text()),
                          "scheduler": {"grace_priod": 2}}, "x.yaml"),
     "search space x.yaml: scheduler: unknown key(s) grace_priod (did you mean 'grace_period'?)"),
    (lambda: parse_study({"name": "t", "config": "configs/demo.yaml", "steps": 4,
                          "arms": [{"name": "a", "equal_flop": False}]}, "s.yaml"),
     "s.yaml: arms[0]: unknown key(s) equal_flop (did you mean 'equal_flops'?)"),
    (lambda: apply_overrides([EvalConfig()], ["batch_sise=4"]), "--set: unknown key(s) batch_sise (did you mean 'batch_size'?)"),
])
def test_an_unknown_key_fails_in_one_line_with_a_suggestion(load, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load()
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_bad_value_fails_in_one_line_naming_the_key_and_type(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: {lr: fast}\n")
    with pytest.raises(ConfigError, match=r"^optim.lr='fast': expected float$"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"^run.max_steps=1.5: expected int$"):
        load_config(None, ["run.max_steps=1.5"])
    with pytest.raises(ConfigError, match=r"^search space x.yaml: num_samples='many': expected int$"):
        parse_space({**yaml.safe_load((ROOT / "tune_spaces" / "demo.yaml").read_text()), "num_samples": "many"}, "x.yaml")


def test_set_values_keep_the_command_line_conventions() -> None:
    cfg = load_config(ROOT / "configs" / "demo.yaml", ["optim.betas=0.8,0.95", "optim.lr=1e-3", "model.adaln=null",
                                                        "scaling.use_gpu=yes", "run.name=123"])
    assert cfg.optim.betas == [0.8, 0.95] and cfg.optim.lr == 1e-3 and cfg.model.adaln is None
    assert cfg.scaling.use_gpu is True and cfg.run.name == "123"
    e = EvalConfig()
    apply_overrides([e], ["splits=validation,test", "use_ema=off", "sampler.eta=0.02", "steps.adlm=4096"])
    assert e.splits == ("validation", "test") and e.use_ema is False
    assert e.sampler_kwargs == {"eta": 0.02} and e.steps_by_kind == {"adlm": 4096}


def test_set_help_is_the_field_descriptions() -> None:
    text = settings_help(EvalConfig, "EvalConfig")
    assert "  t_draws (default 1): Draws of ``t`` per sequence (>1 lowers the variance of the bound;" in text
    assert configlib.descriptions(ModelConfig)["tau"].startswith("ADLM and A2R: a token is an anchor")
    assert "import ast" not in (ROOT / "pipelines" / "core" / "configlib.py").read_text()


@pytest.mark.parametrize("kind", ["recipe", "search_space", "study"])
def test_the_committed_schemas_are_current(kind: str) -> None:
    """Adding, removing or redocumenting a config field changes the generated schema: regenerate and commit it."""
    committed = ROOT / "schemas" / f"{kind}.schema.json"
    assert committed.is_file(), "run python tools/config_schemas.py --write-schemas"
    assert committed.read_text() == config_schemas.schema_text(config_schemas.schemas()[kind]), (
        f"{committed.name} is out of date; run python tools/config_schemas.py --write-schemas")


def test_a_new_field_changes_the_schema() -> None:
    @dataclasses.dataclass
    class Section:
        a: int = 1
        """A."""

    @dataclasses.dataclass
    class Grown(Section):
        b: str = "x"
        """B."""

    one, two = configlib.adapter(Section).json_schema(), configlib.adapter(Grown).json_schema()
    assert set(two["properties"]) - set(one["properties"]) == {"b"} and two["properties"]["b"]["description"] == "B."


@pytest.mark.parametrize("path", RECIPES + SPACES + STUDIES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_yaml_passes_its_committed_schema(path: Path) -> None:
    """What an editor checks as you type: each shipped file against its kind's schema."""
    schema = json.loads((ROOT / "schemas" / f"{KIND_OF[path.parent.name]}.schema.json").read_text())
    jsonschema.validate(yaml.safe_load(path.read_text()) or {}, schema)
    typo = {**(yaml.safe_load(path.read_text()) or {}), "colour": 1}
    with pytest.raises(jsonschema.ValidationError, match="colour"):
        jsonschema.validate(typo, schema)
