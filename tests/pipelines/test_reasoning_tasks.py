"""Reasoning tasks with exact answers: the ProsQA-like and ProntoQA-like generators (answers against a search of
this file's own), their statistics against Coconut's released ProsQA rows (when the shared copy exists), GSM8K's
parsing on a local file in its format, the anchors of the paper's examples, and ``prepare_data``'s reasoning
sources (shards, reuse, one-line refusals)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipelines.data.manifest import read_manifest
from pipelines.data.reasoning import anchors, gsm8k, prontoqa, prosqa
from pipelines.data.reasoning.rows import ReasoningError, parse_rows
from pipelines.prepare_data import main as prepare_main

RELEASED = Path("/work/shared/data/reasoning/prosqa_valid.json")
needs_released = pytest.mark.skipif(not RELEASED.is_file(), reason="Coconut's released ProsQA rows are not here")


def closure_answer(question: str) -> tuple[str, set[str], set[str]]:
    """(asked name, what it reaches, the two options) from the question's text alone: the facts parsed by
    regex and the reachable set grown to a fixed point (no breadth-first search)."""
    facts, _, query = question.rpartition(". Is ")
    edges = {(a, b) for a, b in re.findall(r"(?:Every )?(\w+) is a (\w+)", facts + ".")}
    who, a, b = re.fullmatch(r"(\w+) a (\w+) or (\w+)\?", query).groups()
    reach = {who}
    while True:
        grown = reach | {y for x, y in edges if x in reach}
        if grown == reach:
            return who, reach - {who}, {a, b}
        reach = grown


def test_prosqa_answers_by_brute_force() -> None:
    rows = prosqa.generate(60, 3)
    for row in rows:
        who, reach, options = closure_answer(row["question"])
        hit = options & reach
        assert len(hit) == 1, row["question"]  # exactly one option reachable: a question with one answer
        assert row["answer"] == f"{who} is a {hit.pop()}."
        # the steps are facts of the question, chained from the asked root to the answer
        facts = set(re.split(r"(?<=\.) ", row["question"].rpartition(" Is ")[0]))
        assert all(s in facts for s in row["steps"])
        ends = [re.fullmatch(r"(?:Every )?(\w+) is a (\w+)\.", s).groups() for s in row["steps"]]
        assert ends[0][0] == who and ends[-1][1] in row["answer"]
        assert all(x[1] == y[0] for x, y in zip(ends[:-1], ends[1:], strict=True))
        assert len(row["steps"]) >= prosqa.ProsQAConfig().min_path


def test_prosqa_shortest_path_is_shortest() -> None:
    """No path shorter than the steps: the reachable set after fewer hops (grown one hop at a time) misses it."""
    for row in prosqa.generate(30, 5):
        facts = row["question"].rpartition(" Is ")[0]
        edges = set(re.findall(r"(?:Every )?(\w+) is a (\w+)", facts))
        who, target = row["steps"][0].split()[0], row["answer"].split()[-1].rstrip(".")
        layer = {who}
        for _ in range(len(row["steps"]) - 1):
            layer = layer | {y for x, y in edges if x in layer}
            assert target not in layer
        assert target in layer | {y for x, y in edges if x in layer}


def test_prosqa_small_for_cpu_and_seeded() -> None:
    small = prosqa.generate(50, 1, prosqa.ProsQAConfig(nodes=10, min_path=2))
    assert prosqa.graph_stats(small)["nodes"] < 12
    assert prosqa.generate(5, 9) == prosqa.generate(5, 9) != prosqa.generate(5, 10)
    with pytest.raises(ReasoningError, match="unknown ProsQA option"):
        prosqa.ProsQAConfig.from_dict({"nodez": 3})


@needs_released
def test_prosqa_statistics_match_released_rows() -> None:
    released = json.loads(RELEASED.read_text())
    assert len(released) == 300
    for row in released:  # the released answers agree with both searches
        assert prosqa.solve(row) == row["answer"]
        who, reach, options = closure_answer(row["question"])
        assert row["answer"] == f"{who} is a {(options & reach).pop()}."
    inventory = prosqa.inventory_from_rows(released)
    assert (len(inventory.people), len(inventory.concepts)) == (17, 38)
    ref = prosqa.graph_stats(released)
    got = prosqa.graph_stats(prosqa.generate(300, 0, inventory=inventory))
    assert ref["nodes"] == pytest.approx(22.82) and ref["shortest_path"] == pytest.approx(3.7533, abs=1e-3)
    assert got["nodes"] == pytest.approx(ref["nodes"], rel=0.05)
    assert got["edges"] == pytest.approx(ref["edges"], rel=0.15)
    assert got["shortest_path"] == pytest.approx(ref["shortest_path"], rel=0.05)
    assert got["paths"] == pytest.approx(ref["paths"], rel=0.5)


def test_prontoqa_answers_by_brute_force() -> None:
    cfg = prontoqa.ProntoQAConfig(hops=3, distractor_hops=2)
    rows = prontoqa.generate(80, 0, cfg)
    assert {r["answer"] for r in rows} == {"True", "False"}
    for row in rows:
        facts, _, query = row["question"].rpartition(" True or false: ")
        who, neg, prop = re.fullmatch(r"(\w+) is (not )?(\w+)\.", query).groups()
        isa = dict(re.findall(r"(?:Every )?(\w+) is a (\w+)\.", facts))  # a chain: one class above each
        values = dict((c, n is None or n == "") for c, n in
                      [(m[0], m[1]) for m in re.findall(rf"Every (\w+) is (not )?{prop}\.", facts)])
        assert len(values) == 2  # the chain's property and the distractor's opposite one
        node = who
        while node not in values:
            node = isa[node]
        assert row["answer"] == ("True" if values[node] != bool(neg) else "False")
        assert len(row["steps"]) == cfg.hops + 1 and prontoqa.solve(row) == row["answer"]


def test_gsm8k_parsing_of_a_local_file(tmp_path: Path) -> None:
    path = tmp_path / "gsm8k.jsonl"
    records = [
        {"question": "Janet has 16 eggs. She eats 3 and bakes with 4, then sells each at $2. How much?",
         "answer": "She has 16-3-4=<<16-3-4=9>>9 left.\nShe makes 9*2=$<<9*2=18>>18.\n#### 18"},
        {"question": "A shop sells 1,000 pens at 2 each.", "answer": "1000*2=<<1000*2=2000>>2000\n#### 2,000"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = gsm8k.load_gsm8k("train", data_files=str(path))
    assert rows[0]["steps"] == ["<<16-3-4=9>>", "<<9*2=18>>"] and rows[0]["answer"] == "18"
    assert rows[1]["answer"] == "2000" and rows[1]["question"] == records[1]["question"]
    with pytest.raises(ReasoningError, match="####"):
        gsm8k.parse_solution("no final line")


def test_anchors_of_the_papers_examples() -> None:
    gsm = anchors.number_anchors(["<<16-3-4=9>>", "<<9*2=18>>"])
    assert gsm[:2] == ["16", "3"] and gsm == ["16", "3", "4", "9", "9", "2", "18"]
    trace = ["Tom is a terpus.", "Every terpus is a brimpus.", "Every brimpus is a lempus."]
    assert anchors.node_anchors(trace) == ["Tom", "terpus", "brimpus", "lempus"]
    assert anchors.anchors_of("prontoqa", {"steps": ["Max is a yumpus.", "Max is not bitter."]}) == ["Max", "yumpus"]
    with pytest.raises(ReasoningError, match="unknown reasoning task"):
        anchors.anchors_of("chess", {"steps": []})


def test_malformed_rows_are_refused() -> None:
    with pytest.raises(ReasoningError, match="row 1: no steps"):
        parse_rows(json.dumps([{"question": "q", "steps": [], "answer": "a"}, {"question": "q", "answer": "a"}]), "f")
    with pytest.raises(ReasoningError, match="line 2 is not valid JSON"):
        parse_rows('{"question": "q", "steps": ["s"], "answer": "a"}\n{oops\n', "f")


def _table(split_dir: Path):
    m = read_manifest(split_dir)
    return m, pq.read_table(m.shard_paths()[0])


def test_prepare_data_writes_reasoning_shards(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "prosqa"
    argv = ["--source", "prosqa", "--reasoning", "train_rows=40", "--reasoning", "validation_rows=8",
            "--reasoning", "nodes=10", "--reasoning", "min_path=2", "--split", "train", "--split", "validation",
            "--out", str(out), "-q"]
    assert prepare_main(argv) == 0
    assert "train: 40 rows" in capsys.readouterr().out
    m, tab = _table(out / "train")
    assert m.mode == "reasoning" and m.rows == 40 and m.truth["task"] == "prosqa"
    rows = tab.to_pylist()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    r = rows[0]
    assert tok.decode(r["question_ids"]).split() == re.findall(r"\w+|[^\w\s]+", r["question"])
    assert r["anchors"] == anchors.node_anchors(r["steps"])
    assert [tok.id_to_token(i) for i in r["anchor_ids"]] == r["anchors"]
    assert {k: tok.token_to_id(k) for k in ("[BoA]", "[EoA]", "[ANT]")} == {
        k: m.options["markers"][k] for k in ("[BoA]", "[EoA]", "[ANT]")}
    shas = [s.sha256 for s in m.shards]
    assert prepare_main(argv) == 0  # reused, the same bytes
    assert [s.sha256 for s in read_manifest(out / "train").shards] == shas
    assert prepare_main([*argv[:-3], "--reasoning", "seed=1", "--out", str(out), "-q"]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_prepare_data_local_files_and_their_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "rows.json"
    good.write_text(json.dumps(prontoqa.generate(6, 2, prontoqa.ProntoQAConfig(hops=2, distractor_hops=1))))
    out = tmp_path / "out"
    assert prepare_main(["--source", f"train={good}", "--reasoning", "task=prontoqa", "--out", str(out), "-q"]) == 0
    m, tab = _table(out / "train")
    assert m.rows == 6 and tab.column("answer").to_pylist() == [r["answer"] for r in json.loads(good.read_text())]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"question": "q", "answer": "a"}]))
    code = prepare_main(["--source", f"train={bad}", "--reasoning", "task=prosqa", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("prepare_data: error:") and "no steps" in err[0]
    assert not (tmp_path / "x").exists()  # refused before anything is written
    code = prepare_main(["--source", f"train={good}", "--reasoning", "task=chess", "--out", str(tmp_path / "y")])
    assert code == 2 and "task=chess" in capsys.readouterr().err
