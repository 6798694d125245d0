"""pipelines/studies/floors.py: the context-free floors of a split, estimated from its rows, agree with the exact
floors of the testbed language, and the in-sample floor is the lower one."""

from __future__ import annotations

import pytest

from pipelines.data.prepare import PrepareConfig, prepare
from pipelines.studies.floors import floors, main


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    out = tmp_path_factory.mktemp("floors") / "testbed"
    prepare(PrepareConfig.from_dict({"source": "testbed", "out": str(out), "split": ["train", "validation"],
             "testbed": {"length": 16, "entropy_rows": 300, "train_rows": 20000, "validation_rows": 4000}}))
    return out


def test_estimated_floors_match_the_exact_ones(split):
    res = floors(str(split / "validation"), str(split / "train"))
    for pos in ("all_positions", "skip_first"):
        r, exact = res[pos], res["exact"][pos]
        assert r["unigram_fit_on_train"] == pytest.approx(exact["unigram"], abs=0.03)
        assert r["unigram_position_fit_on_train"] == pytest.approx(exact["unigram_position"], abs=0.03)
        assert r["unigram_position_in_sample"] <= r["unigram_position_fit_on_train"]
        assert r["unigram_position_in_sample"] <= r["unigram_in_sample"] <= r["unigram_fit_on_train"]
    assert res["exact"]["entropy"]["all_positions"] < res["all_positions"]["unigram_position_in_sample"]


def test_cli_prints_the_table_and_result_lines(split, capsys):
    assert main([str(split / "validation")]) == 0
    out = capsys.readouterr().out
    assert "| unigram position in sample | all L |" in out and "RESULT unigram_in_sample_skip_first=" in out
    assert main([str(split / "missing")]) == 2
