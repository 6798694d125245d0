"""The registry's own check of model names and aliases (``pipelines.tracking.registry.check_names``) agrees with what a real
MLflow registry accepts and refuses: the rules are the project's (MLflow's validators are private and were renamed in
3.18), so a release that changes MLflow's rules fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.tracking.registry import RegistryError, alias_problem, check_names, name_problem

NAMES = ["adlm", "a model", "a.b", "x-1_y", "", "  ", "a/b", "team:adlm", "..", ".", "a/../b", "./a"]
ALIASES = ["champion", "candidate", "fast-1", "_x", "", "bad alias!", "a.b", "latest", "LATEST", "v3", "V12", "v",
           "version3", "x" * 255, "x" * 256]


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory):
    from mlflow import MlflowClient

    d: Path = tmp_path_factory.mktemp("names")
    c = MlflowClient(tracking_uri=f"sqlite:///{d / 'mlflow.db'}", registry_uri=f"sqlite:///{d / 'mlflow.db'}")
    c.create_registered_model("adlm")
    c.create_model_version("adlm", source=str(d))
    return c


def _accepted(call) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        call()
    except MlflowException:
        return False
    return True


def test_names_agree_with_the_registry(registry) -> None:
    for name in NAMES:
        ours = name_problem(name) is None
        theirs = name == "adlm" or _accepted(lambda n=name: registry.create_registered_model(n))
        assert ours == theirs, f"{name!r}: the check {'accepts' if ours else 'refuses'} it, MLflow does not agree"


def test_aliases_agree_with_the_registry(registry) -> None:
    for alias in ALIASES:
        ours = alias_problem(alias) is None
        theirs = _accepted(lambda a=alias: registry.set_registered_model_alias("adlm", a, "1"))
        assert ours == theirs, f"{alias!r}: the check {'accepts' if ours else 'refuses'} it, MLflow does not agree"


@pytest.mark.parametrize(("name", "aliases", "line"), [
    ("a/b", (), "--name: Invalid model name 'a/b'. Names cannot contain '/' or ':'."),
    ("adlm", ("ok", "bad alias!"), "--alias: Invalid alias name: 'bad alias!'. Names may only contain alphanumerics"),
    ("adlm", ("v3",), "--alias: Version alias name 'v3' is reserved."),
    ("adlm", ("Latest",), "--alias: 'latest' alias name (case insensitive) is reserved."),
    (None, ("",), "--alias: Registered model alias name cannot be empty."),
])
def test_a_refusal_is_one_line_naming_the_flag(name: str | None, aliases: tuple[str, ...], line: str) -> None:
    with pytest.raises(RegistryError) as e:
        check_names(name, aliases)
    assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)


def test_good_names_pass() -> None:
    check_names("adlm", ("champion", "candidate", "ssd-lm_1"))
    check_names(None, ())
