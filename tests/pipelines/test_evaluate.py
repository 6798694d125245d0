"""pipelines.evaluate: the NELBO bound equals the training code's, the full suite logs to MLflow and tags the
registry version, Ray and in-process agree, bad input fails in one line before any work."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from adlm_model import compute_loss, load_checkpoint
from pipelines.evaluate import main
from pipelines.evaluation.config import EvalConfig
from pipelines.evaluation.jobs import batch_seed
from pipelines.evaluation.metrics import unigram_entropy
from pipelines.evaluation.run import evaluate_model
from tests.support.eval import make_data, register, save_ckpt, tiny_config, tiny_gpt2, train_tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    """Data (KJV + Wikipedia, a trained 384-entry BPE) and two briefly trained tiny checkpoints."""
    root = tmp_path_factory.mktemp("eval")
    data, tok, tok_path = make_data(root)
    from pipelines.data.reader import read_rows

    rows, _ = read_rows(str(data / "train"))
    out = {"root": root, "data": data, "tok": tok, "tok_path": tok_path}
    for kind, steps in (("mdlm", 40), ("adlm", 25)):
        cfg = tiny_config(tok, kind)
        model, ema = train_tiny(cfg, rows, steps)
        out[kind] = save_ckpt(root / f"ck-{kind}", model, cfg, ema, tok_path, data, step=steps)
    return out


def _val_rows(data: Path) -> np.ndarray:
    """The validation rows read straight from the Parquet shards (not through evaluate's reader)."""
    parts = sorted((data / "validation").glob("part-*.parquet"))
    return np.concatenate([np.stack(pq.read_table(p).column("input_ids").to_pylist()) for p in parts]).astype(np.int64)


@pytest.mark.parametrize("kind", ["mdlm", "adlm"])
def test_ppl_equals_the_training_code_nelbo_on_the_same_batches(art, kind):
    bs, n_batches = 16, 4
    cfg = EvalConfig(splits=("validation",), batch_size=bs, max_rows=bs * n_batches, seed=3)
    r = evaluate_model(str(art[kind]), "ppl", cfg, in_process=True, log=False)

    # The training objective (train=True), EMA weights, the same rows and the same per-batch seeds.
    model, mcfg, _ = load_checkpoint(art[kind])  # EMA weights by default
    model.eval()
    # max_rows takes rows spread evenly over the split (its first rows would be one or two documents).
    rows = _val_rows(art["data"])
    x_all = torch.from_numpy(rows[np.linspace(0, len(rows) - 1, bs * n_batches).round().astype(int)])
    assert len(rows) > bs * n_batches
    nelbo = []
    with torch.no_grad():
        for k in range(n_batches):
            g = torch.Generator().manual_seed(batch_seed(3, k, 0))
            out = compute_loss(model, x_all[k * bs:(k + 1) * bs], None, mcfg, step=10**6, train=True, generator=g)
            # MDLM trains on the NELBO itself; ADLM's training loss adds the anchor term, its NELBO is nll_sum.
            if kind == "mdlm":
                assert float(out.loss) == pytest.approx(float(out.nll_sum / out.n_tokens), rel=1e-6)
            nelbo.append(float(out.nll_sum / out.n_tokens))
    assert r.metrics["val_rows"] == bs * n_batches and r.metrics["val_tokens"] == bs * n_batches * mcfg.seq_len
    assert math.log(r.metrics["val_ppl"]) == pytest.approx(float(np.mean(nelbo)), rel=1e-5)
    assert r.table[0]["bound"] is True
    # The model learned something: far below the uniform bound log(384).
    assert r.metrics["val_ppl"] < 300


def test_several_t_draws_pool_tokens_and_differ_from_one_draw(art):
    one = evaluate_model(str(art["mdlm"]), "ppl", EvalConfig(splits=("validation",), max_rows=32, batch_size=16),
                         in_process=True, log=False).metrics
    two = evaluate_model(str(art["mdlm"]), "ppl",
                         EvalConfig(splits=("validation",), max_rows=32, batch_size=16, t_draws=2),
                         in_process=True, log=False).metrics
    assert two["val_tokens"] == 2 * one["val_tokens"]  # every draw counts its tokens
    assert two["val_ppl"] != one["val_ppl"]
    assert abs(math.log(two["val_ppl"]) - math.log(one["val_ppl"])) < 0.5


def test_ray_tasks_give_exactly_the_in_process_figures(art, ray_session):
    cfg = EvalConfig(splits=("validation",), max_rows=64, batch_size=16, rows_per_task=20, cpus_per_task=0.5)
    local = evaluate_model(str(art["mdlm"]), "ppl", cfg, in_process=True, log=False)
    remote = evaluate_model(str(art["mdlm"]), "ppl", cfg, in_process=False, log=False)  # 2 tasks of 32 rows
    assert remote.settings["executor"] == "ray"
    assert remote.metrics == local.metrics


def test_full_suite_logs_an_evaluation_run_linked_to_the_model_version(art, workdir):
    import mlflow

    tracking = f"sqlite:///{workdir / 'mlflow.db'}"
    mv = register(art["mdlm"], tracking)
    cfg = EvalConfig(eval_lm=str(tiny_gpt2(art["root"])), mauve_featurizer="minilm", num_samples=50,
                     sample_batch_size=25, steps=4, sampler="mdlm", max_rows=64)
    r = evaluate_model("models:/adlm@candidate", "ppl,gen_ppl,mauve", cfg, in_process=True)

    client = mlflow.MlflowClient(tracking)
    run = client.get_run(r.run_id)
    assert run.data.tags["model_name"] == "adlm" and run.data.tags["model_version"] == str(mv.version)
    for k in ("val_ppl", "gen_ppl", "entropy", "mauve"):
        assert run.data.metrics[k] == pytest.approx(r.metrics[k])
    assert 0.0 <= r.metrics["mauve"] <= 1.0 and r.metrics["gen_ppl"] > 1.0
    assert run.data.params["sampler"] == "mdlm" and run.data.params["steps"] == "4"
    arts = {f.path for f in client.list_artifacts(r.run_id)}
    assert {"summary.md", "summary.json", "samples.jsonl", "ppl.png", "entropy.png"} <= arts
    local = Path(mlflow.artifacts.download_artifacts(run_id=r.run_id, tracking_uri=tracking))
    samples = [json.loads(line) for line in (local / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 50 and all(len(s["ids"]) == 32 for s in samples)
    assert r.metrics["entropy"] == pytest.approx(float(np.mean([unigram_entropy(s["ids"]) for s in samples])))
    md = (local / "summary.md").read_text()
    assert "validation PPL | <= " in md and "featurizer minilm" in md and "sampler mdlm, T=4, p=0.9, 50 samples" in md
    summary = json.loads((local / "summary.json").read_text())
    assert summary["metrics"]["gen_ppl"] == pytest.approx(r.metrics["gen_ppl"])

    tags = client.get_model_version("adlm", mv.version).tags
    assert tags["eval.run_id"] == r.run_id
    assert float(tags["val_ppl"]) == pytest.approx(r.metrics["val_ppl"], rel=1e-5)
    assert float(tags["gen_ppl"]) == pytest.approx(r.metrics["gen_ppl"], rel=1e-5)
    assert float(tags["mauve"]) == pytest.approx(r.metrics["mauve"], rel=1e-5)
    assert tags["gen.settings"].startswith("sampler=mdlm T=4 p=0.9 n=50") and tags["mauve.featurizer"] == "minilm"
    # The gen-PPL figure names its definition: the reference's first-token convention by default.
    assert tags["gen_ppl.definition"].endswith("first token scored after the LM's EOS (reference)")
    assert f"truncated to {cfg.gen_ppl_max_length}" in tags["gen_ppl.definition"]


def _fails(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()  # MLflow may log its own INFO lines first
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0]
    return errors[0]


def test_bad_input_fails_in_one_line_before_any_work(art, workdir, capsys, tmp_path):
    import mlflow

    ck = str(art["mdlm"])
    assert "no alias 'nope'" in _fails(capsys, "--model", "models:/adlm@nope", "--in-process")
    assert "bad model URI" in _fails(capsys, "--model", "models:/adlm", "--in-process")
    assert "neither a models:/ URI nor a checkpoint" in _fails(capsys, "--model", str(tmp_path / "x"), "--in-process")
    # A checkpoint whose vocabulary does not match the data manifest.
    bad = tiny_config(art["tok"], "mdlm", vocab_size=500)
    from adlm_model import build_model

    other = save_ckpt(tmp_path / "other", build_model(bad), bad, None, art["tok_path"], art["data"])
    assert "does not fit the model" in _fails(capsys, "--model", str(other), "--in-process")
    assert "smollm2" in _fails(capsys, "--model", ck, "--suite", "gen_ppl", "--set", "eval_lm=gpt2-large",
                               "--in-process")
    assert "at least 50 samples, got 10" in _fails(capsys, "--model", ck, "--suite", "mauve", "--set",
                                                   "num_samples=10", "--set", "mauve_featurizer=minilm", "--in-process")
    assert "unknown suite" in _fails(capsys, "--model", ck, "--suite", "ppl,bleu")
    assert "--set: unknown key(s) colour; known:" in _fails(capsys, "--model", ck, "--set", "colour=red")
    assert "expected int" in _fails(capsys, "--model", ck, "--set", "batch_size=many")
    assert "zero_shot=NAME=DIR" in _fails(capsys, "--model", ck, "--suite", "zero_shot", "--in-process")
    assert "known: alpha_on, eta, t_off, t_on" in _fails(capsys, "--model", ck, "--suite", "generate", "--set",
                                                           "sampler=remdm-loop", "--set", "sampler.etta=0.1")
    assert "block 5 does not divide the length 32" in _fails(capsys, "--model", ck, "--suite", "generate", "--set",
                                                            "sampler=confidence", "--set", "sampler.block=5")
    # Nothing was logged.
    client = mlflow.MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("adlm-eval")
    assert exp is None or not client.search_runs([exp.experiment_id])


def test_shared_cache_never_confuses_version_1_of_two_stores(art, tmp_path, monkeypatch):
    """Two registries each with a version 1 of a different checkpoint, one ADLM_CACHE (as in CI and on a
    shared box): each URI must resolve to its own weights (a cache keyed by name and number mixed them up)."""
    from safetensors.torch import load_file

    from pipelines.tracking.registry import resolve_model_ref

    monkeypatch.setenv("ADLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("ADLM_WORKDIR", str(tmp_path / "work"))  # the registered files, not under ./work
    got = {}
    for kind in ("mdlm", "adlm"):
        uri = f"sqlite:///{tmp_path / kind}.db"
        register(art[kind], uri, name="adlm", kind=kind)
        ref = resolve_model_ref("models:/adlm/1", uri)
        assert ref.version == "1"
        got[kind] = Path(ref.local_dir)
    assert got["mdlm"] != got["adlm"]
    # Downloads go through a temporary folder beside the cache entry, removed afterwards (they leaked into /tmp):
    # the cache holds exactly one entry per version, each the MLflow Model whose checkpoint was resolved.
    entries = sorted((tmp_path / "cache" / "models").iterdir())
    assert len(entries) == 2 and all((e / "MLmodel").is_file() for e in entries)
    assert sorted(e.name for e in entries) == sorted(next(e.name for e in entries if d.is_relative_to(e))
                                                     for d in got.values())
    for kind, d in got.items():
        want, have = load_file(art[kind] / "model.safetensors"), load_file(d / "model.safetensors")
        assert want.keys() == have.keys() and all(torch.equal(want[k], have[k]) for k in want), kind


def test_zero_shot_sets_form_one_table(art, tmp_path):
    # Two "zero-shot" sets: prepared data folders found under one root.
    import shutil

    root = tmp_path / "zs"
    for name in ("bible", "wiki"):
        shutil.copytree(art["data"] / "validation", root / name / "test")
    cfg = EvalConfig(zero_shot=(str(root),), max_rows=16, batch_size=16)
    r = evaluate_model(str(art["mdlm"]), "zero_shot", cfg, in_process=True, log=False)
    assert [row["quantity"] for row in r.table] == ["zero_shot/bible PPL", "zero_shot/wiki PPL"]
    assert r.metrics["zero_shot_bible_ppl"] == r.metrics["zero_shot_wiki_ppl"]  # same rows, same seeds


def test_cli_help_documents_every_setting():
    out = subprocess.run([sys.executable, "-m", "pipelines.evaluate", "--help"], capture_output=True, text=True,
                         check=True).stdout
    from pipelines.evaluation.config import EvalConfig
    from pipelines.evaluation.promotion import PromotionConfig

    for flag in ("--model", "--suite", "--set", "--stage-all", "--in-process", "--ray-address", "--data", "--name"):
        assert flag in out
    import dataclasses

    for cls in (EvalConfig, PromotionConfig):
        for f in dataclasses.fields(cls):
            assert f"  {f.name} (default" in out, f.name
    assert "smollm2" in out and "minilm" in out


def test_a_metric_registered_in_one_place_reaches_the_plan_run_report_tags_and_gate(art, workdir, monkeypatch):
    """One ``Suite`` entry (and its function) is all a new metric needs: the planner checks it, the runner runs
    it, the summary shows it, the registry version is tagged with it, promotion can gate on it, and its ``Figure``
    reaches the model card and the pipeline's summary (docs/design/architecture.md: a metric touches suites.py)."""
    import mlflow

    from pipelines.evaluation import suites
    from pipelines.evaluation.plan import plan_evaluation
    from pipelines.evaluation.promotion import PromotionConfig, gate_reasons
    from pipelines.evaluation.report import summary_markdown
    from pipelines.evaluation.suites import Figure, Gate, Suite

    seen = {}

    def check(cfg, tracking_uri):
        if cfg.seed < 0:
            raise suites.EvalError("toy needs seed >= 0")

    def plan(p):
        seen["planned"] = p.ref.local_dir

    def run(state):  # shares the NELBO of the planned datasets with ppl (scored once)
        pooled, _ = state.nelbo()["validation"]
        state.metrics["toy_score"] = 2.0 * pooled.nll
        state.row("toy score", state.metrics["toy_score"], "twice the validation NELBO per token", stderr=0.01)

    monkeypatch.setitem(suites.SUITES, "toy", Suite(
        "toy", "a toy metric", run, implies=("ppl",), check=check, plan=plan, headline=("toy_score",),
        tags=lambda result, cfg: {"toy.settings": f"seed={cfg.seed}"},
        gates=(Gate("toy_score", "max", "toy_score_max", "toy score"),), in_stage2=False,
        figures=(Figure("toy_score", "Toy score", "toy", "Twice the validation NELBO per token.", ("toy.settings",)),)))

    tracking = f"sqlite:///{workdir / 'mlflow.db'}"
    mv = register(art["mdlm"], tracking)
    cfg = EvalConfig(splits=("validation",), max_rows=16, batch_size=16)
    assert plan_evaluation("models:/adlm@candidate", "toy", cfg).suite == ("ppl", "toy")
    assert seen["planned"]
    with pytest.raises(suites.EvalError, match="toy needs seed"):
        plan_evaluation(str(art["mdlm"]), "toy", EvalConfig(seed=-1))
    r = evaluate_model("models:/adlm@candidate", "toy", cfg, in_process=True)
    assert r.metrics["toy_score"] == pytest.approx(2.0 * r.metrics["val_nll"])
    assert "| toy score | " in summary_markdown(r) and " ± 0.0100 |" in summary_markdown(r)
    tags = mlflow.MlflowClient(tracking).get_model_version("adlm", mv.version).tags
    assert float(tags["toy_score"]) == pytest.approx(r.metrics["toy_score"], rel=1e-5)
    assert tags["toy.settings"] == "seed=0" and "val_ppl" in tags
    assert mlflow.MlflowClient(tracking).get_run(r.run_id).data.metrics["toy_score"] == pytest.approx(r.metrics["toy_score"])
    from adlm_model.interop.checkpoint import read_config
    from pipelines.orchestration.summary import summary_markdown as pipeline_summary
    from pipelines.serving.export import _Source, model_card

    card = model_card(_Source("models:/adlm@candidate", str(art["mdlm"]), name="adlm", version=mv.version, tags=tags),
                      read_config(art["mdlm"])[0], {}, 1)
    assert f"| Toy score (`toy_score`) | {tags['toy_score']} | toy.settings: seed=0 |" in card
    assert "- **Toy score**: Twice the validation NELBO per token." in card
    row = {"model": "MDLM", "version": mv.version, "kind": "mdlm", "gamma": None, "tau": None, "status": None,
           "champion": False, "gen_ppl": None, "gen_ppl_definition": None, "toy_score": float(tags["toy_score"])}
    md = pipeline_summary({"profile": "demo", "model_name": "adlm", "champion": None, "rows": [row], "timings_s": {},
                           "tracking_uri": tracking, "comparable": False})
    assert "| toy | status |" in md and f"| {float(tags['toy_score']):.3f} | - |" in md
    promo = PromotionConfig(bounds={"toy_score_max": r.metrics["toy_score"] - 1}).validate()
    assert gate_reasons(r.metrics, r.suite, promo) == [
        f"gate: toy score {r.metrics['toy_score']:.4f} above the bound {r.metrics['toy_score'] - 1:g}"]
    assert gate_reasons(r.metrics, r.suite, PromotionConfig()) == []  # no bound set: no gate
    assert "toy" not in PromotionConfig().stage2_suite
