"""Anchored chain-of-thought fine-tuning's schedule: the stages of each arm, the optimiser reset at a stage switch,
greedy decoding (the cached decoding equals recomputing, no ``[ANT]`` or marker is emitted, a row stops at its
EOS), the kept checkpoint (the best validation accuracy of the last stage), and the loop learning a toy task
above chance."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from adlm_model.config import ModelConfig
from adlm_model.kinds import build_model
from adlm_model.sampling.greedy import greedy_decode
from adlm_model.train.stages import ARMS, EpochRecord, Stage, StagedFineTuning, arm_stages, coconut_stages
from pipelines.data.reasoning.layout import Markers, collate, lay_out

MK = Markers(bos=1, eos=2, pad=0, boa=3, eoa=4, ant=5, answer=(6,))
VOCAB = 24
TOY_ROWS = 192
TOY_EPOCHS = 4


def tiny(seed: int = 0, seq_len: int = 24) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = ModelConfig(kind="ar", vocab_size=VOCAB, mask_id=VOCAB, seq_len=seq_len, hidden=32, heads=2, n_blocks=2,
                      cond_dim=16, dropout=0.0)
    return build_model(cfg)


def test_stages_of_the_arms() -> None:
    assert [(s.n_ant, s.removed_steps) for s in coconut_stages(3, 5, remove_steps=True)] == [
        (0, 0), (1, 1), (2, 2), (3, 3)]
    assert [s.removed_steps for s in coconut_stages(2, 3)] == [0, 0, 0]  # GSM8K and ProntoQA keep the trace
    assert arm_stages("acot", 2, 3) == arm_stages("pause_as_thought", 2, 3) == coconut_stages(2, 3)
    assert arm_stages("pause", 6, 5) == [Stage(0, 6, 0, 35)]  # six pause tokens, the schedule's 35 epochs
    assert arm_stages("cot", 6, 5) == arm_stages("no_cot", 6, 5) == [Stage(0, 0, 0, 35)]
    assert not ARMS["no_cot"].cot and not ARMS["pause"].cot and ARMS["acot"].anchors
    assert not ARMS["pause_as_thought"].anchors
    with pytest.raises(ValueError, match="unknown arm"):
        arm_stages("latent", 2, 3)


def _toy_rows(n: int, seed: int) -> list[tuple[list[int], list[list[int]], list[int], list[int]]]:
    """Questions of three tokens; the trace's one step is the first token, the answer the second, the anchor
    the first (chance: 1/8)."""
    g = torch.Generator().manual_seed(seed)
    qs = torch.randint(8, 16, (n, 3), generator=g).tolist()
    return [(q, [[q[0]]], [q[1]], [q[0]]) for q in qs]


def _batch(rows: list, stage: Stage) -> dict[str, torch.Tensor]:
    laid = [lay_out(q, s, a, an, MK, stage.n_ant, removed_steps=stage.removed_steps) for q, s, a, an in rows]
    return {k: torch.as_tensor(v) for k, v in collate(laid, MK.pad).items()}


def _adamw(params: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)  # type: ignore[arg-type]


def test_stage_switch_resets_the_optimizer(one_torch_thread: None) -> None:
    model = tiny()
    stages = coconut_stages(1, 1, remove_steps=True)
    ft = StagedFineTuning(model, stages, _adamw, anchor_weight=1.0, exclude=VOCAB)
    ft.begin_stage(stages[0])
    for i in range(3):
        ft.step([_batch(_toy_rows(8, i), stages[0])])
    old = ft.optimizer
    assert old is not None and len(old.state) > 0
    old_state = copy.deepcopy(old.state_dict())
    fresh = ft.begin_stage(stages[1])
    assert fresh is not old and len(fresh.state) == 0
    start = copy.deepcopy(model.state_dict())
    batch = [_batch(_toy_rows(8, 9), stages[1])]
    ft.step(batch)
    after_switch = copy.deepcopy(model.state_dict())
    # the same step from a brand-new optimiser gives the same weights
    model.load_state_dict(start)
    ref = StagedFineTuning(model, stages, _adamw, anchor_weight=1.0, exclude=VOCAB)
    ref.begin_stage(stages[1])
    ref.step(batch)
    assert all(torch.equal(after_switch[k], v) for k, v in model.state_dict().items())
    # and it differs from the step the old optimiser (its moments) would have taken: the test can fail
    model.load_state_dict(start)
    kept = _adamw(model.parameters())
    kept.load_state_dict(old_state)
    cont = StagedFineTuning(model, stages, lambda p: kept, anchor_weight=1.0, exclude=VOCAB)
    cont.begin_stage(stages[1])
    cont.step(batch)
    assert not all(torch.equal(after_switch[k], v) for k, v in model.state_dict().items())


def _recompute_greedy(model: torch.nn.Module, prompt: list[int], eos: int, max_new: int, banned: list[int]
                      ) -> list[int]:
    """Greedy decoding by recomputing the whole prefix each step (no cache): the reference."""
    x, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([x]))[0, -1].float()
            logits[banned] = float("-inf")
            t = int(logits.argmax())
            out.append(t)
            x.append(t)
            if t == eos:
                break
    return out


def test_greedy_decoding_suppresses_ant_and_stops_at_eos(one_torch_thread: None) -> None:
    model = tiny(3, seq_len=32)
    model.eval()
    bias = model.backbone.output_layer.linear.bias
    with torch.no_grad():  # a network whose favourite output is [ANT], EOS close behind a few tokens
        bias[MK.ant] = 50.0
        bias[MK.eos] = 1.5
        model.backbone.output_layer.linear.weight.normal_(0, 0.5)
    prompts = [[1, 9, 3, 5, 5, 4], [1, 10, 11, 3, 4], [1, 12, 13, 3, 4], [1, 14, 3, 5, 4], [1, 3, 4]]
    raw = greedy_decode(model, prompts, eos_id=MK.eos, max_new=12)
    assert all(MK.ant in r for r in raw)  # unsuppressed, the [ANT] output would be read as text
    banned = [MK.ant, MK.boa, MK.eoa]
    outs = greedy_decode(model, prompts, eos_id=MK.eos, max_new=12, suppress=banned, batch_size=2)
    assert outs == [_recompute_greedy(model, p, MK.eos, 12, banned) for p in prompts]
    assert not any(t in banned for r in outs for t in r)
    stopped = [r for r in outs if r[-1] == MK.eos]
    assert stopped and all(r.count(MK.eos) == 1 and len(r) < 12 for r in stopped)  # nothing after the EOS
    assert any(len(r) == 12 and MK.eos not in r for r in outs)  # and the others run to max_new


@dataclass
class ToyRun:
    history: list[EpochRecord]
    snapshots: list[dict[str, torch.Tensor]]
    result: object
    model: torch.nn.Module
    validate: object


def _accuracy(model: torch.nn.Module, rows: list, stage: Stage) -> float:
    """Exact match of the greedy answer (the tokens after ``###`` up to EOS) with the gold answer."""
    laid = [lay_out(q, s, a, an, MK, stage.n_ant, removed_steps=stage.removed_steps) for q, s, a, an in rows]
    outs = greedy_decode(model, [x.input_ids[:x.prompt_len] for x in laid], eos_id=MK.eos, max_new=6,
                         suppress=(MK.ant, MK.boa, MK.eoa, MK.bos, MK.pad))
    hits = 0
    for (_, _, a, _), out in zip(rows, outs, strict=True):
        tail = out[len(out) - 1 - out[::-1].index(MK.answer[0]):] if MK.answer[0] in out else []
        hits += tail == [MK.answer[0], *a, MK.eos]
    return hits / len(rows)


@pytest.fixture(scope="module")
def toy_run() -> ToyRun:
    """The ACoT arm on the toy task, two stages (the second removes the step and adds an [ANT]), a few seconds."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny(1)
        stages = coconut_stages(1, TOY_EPOCHS, remove_steps=True)
        train, val = _toy_rows(TOY_ROWS, 11), _toy_rows(128, 12)
        ft = StagedFineTuning(model, stages, _adamw, anchor_weight=1.0, exclude=VOCAB)
        snapshots: list[dict[str, torch.Tensor]] = []

        def batches(stage: Stage, epoch: int):
            for lo in range(0, len(train), 32):
                yield [_batch(train[lo:lo + 32], stage)]

        def validate(m: torch.nn.Module, stage: Stage) -> float:
            return _accuracy(m, val, stage)

        result = ft.run(batches, validate,
                        lambda rec: snapshots.append({k: v.clone() for k, v in model.state_dict().items()}))
        return ToyRun(result.history, snapshots, result, model, validate)
    finally:
        torch.set_num_threads(n)


def test_accuracy_rises_above_chance(toy_run: ToyRun) -> None:
    accs = [r.accuracy for r in toy_run.history]
    assert len(accs) == 2 * TOY_EPOCHS and toy_run.result.steps == 2 * TOY_EPOCHS * TOY_ROWS // 32
    assert accs[0] < 0.125 < 0.25 < max(accs)  # chance 1/8 (the answer token is one of eight): above it twice
    stage1 = toy_run.history[TOY_EPOCHS:]
    assert stage1[-1].anchor_ce < stage1[0].anchor_ce  # the [ANT] outputs learn their anchors
    assert all(r.anchor_ce != r.anchor_ce for r in toy_run.history[:TOY_EPOCHS])  # stage 0 has no [ANT]: NaN


def test_best_accuracy_checkpoint_is_kept(toy_run: ToyRun) -> None:
    hist, res = toy_run.history, toy_run.result
    last = [i for i, r in enumerate(hist) if r.stage == 1]
    best_i = max(last, key=lambda i: (hist[i].accuracy, -i))  # the first of the best (a tie keeps the earlier)
    assert (res.best_stage, res.best_epoch, res.best_accuracy) == (1, hist[best_i].epoch, hist[best_i].accuracy)
    assert not any(r.kept for r in hist[:TOY_EPOCHS])  # stage 0 is read with another layout: not eligible
    assert all(torch.equal(res.best_state[k], v) for k, v in toy_run.snapshots[best_i].items())
    model = copy.deepcopy(toy_run.model)
    model.load_state_dict(res.best_state)
    assert toy_run.validate(model, Stage(1, 1, 1, TOY_EPOCHS)) == res.best_accuracy  # the kept weights re-score the same


# ---- the command: python -m pipelines.train with an acot recipe ---------------------------------------------

RECIPE = "configs/acot_prosqa_cpu.yaml"


@pytest.fixture(scope="module")
def prosqa_work(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A work directory with tiny ProsQA-like splits where the recipe expects them, and the recipe's model and
    schedule scaled down to seconds (the vocabulary is the one these rows give)."""
    from pipelines.data.manifest import read_manifest
    from pipelines.prepare_data import main as prepare_main

    wd = tmp_path_factory.mktemp("acot-work")
    out = wd / "data" / "prosqa-cpu"
    assert prepare_main(["--source", "prosqa", "--reasoning", "train_rows=48", "--reasoning", "validation_rows=12",
                         "--reasoning", "nodes=8", "--reasoning", "min_path=2", "--split", "train", "--split",
                         "validation", "--out", str(out), "-q"]) == 0
    m = read_manifest(out / "train")
    sets = [f"--set={s}" for s in (f"model.vocab_size={m.vocab_size}", "model.hidden=16", "model.n_blocks=1", "acot.max_ant=1",
            "acot.epochs_per_stage=1", "batch.global_batch=16", "batch.micro_batch=8", "scaling.threads=1")]
    return wd, sets


def test_train_command_fine_tunes_and_registers_with_accuracy(prosqa_work: tuple[Path, list[str]],
                                                              capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow

    from adlm_model.interop.checkpoint import read_config
    from pipelines.data.reasoning.answers import exact_match
    from pipelines.tracking.runs import client
    from pipelines.train import main as train_main

    wd, sets = prosqa_work
    uri = f"sqlite:///{wd / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert train_main(["--config", RECIPE, "--workdir", str(wd), *sets, "-q"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["arm"] == "acot" and out["step"] == 2 * 3  # two stages, one epoch each, 48 rows / 16 a step
    c = client(uri)
    mv = c.get_model_version("acot-prosqa", out["registered_version"])
    assert mv.tags["arm"] == "acot" and mv.tags["n_ant"] == "1" and mv.tags["task"] == "prosqa"
    assert float(mv.tags["accuracy"]) == pytest.approx(out["accuracy"])
    assert (mv.tags["correct"], mv.tags["total"]) == (str(out["correct"]), "12")
    # the per-row answers: every validation row, their share of exact matches is the registered accuracy
    local = mlflow.artifacts.download_artifacts(run_id=out["run_id"], artifact_path="answers/validation.jsonl",
                                                tracking_uri=uri)
    records = [json.loads(x) for x in Path(local).read_text().splitlines()]
    assert len(records) == 12 and "###" not in "".join(r["predicted"] for r in records)
    assert all(r["correct"] == exact_match(r["generated"], r["gold"]) for r in records)
    assert sum(r["correct"] for r in records) / 12 == pytest.approx(out["accuracy"])
    # the loss parts and the accuracy of each epoch, at the optimiser step the epoch ended
    hist = {k: [(m.step, m.value) for m in c.get_metric_history(out["run_id"], k)]
            for k in ("val_accuracy", "stage", "train_sft_nll", "train_anchor_ce")}
    assert hist["stage"] == [(3, 0.0), (6, 1.0)] and len(hist["val_accuracy"]) == 2
    assert [s for s, _ in hist["train_anchor_ce"]] == [6]  # stage 0 has no [ANT]: no anchor term logged
    cfg, meta = read_config(Path(out["checkpoint_dir"]))
    assert cfg.kind == "ar" and meta["arm"] == "acot" and meta["n_ant"] == 1 and meta["best_stage"] == 1


@pytest.mark.parametrize(("sets", "says"), [
    (["scaling.num_workers=2"], "set scaling.num_workers=0"),
    (["acot.arm=latent"], "acot.arm 'latent'"),
    (["model.kind=mdlm"], "set model.kind=ar"),
    (["model.vocab_size=7"], "model.vocab_size="),
    (["model.seq_len=32"], "set model.seq_len="),
    (["data.train=data/nowhere/train"], "data.train"),
])
def test_bad_acot_input_is_one_line_before_any_work(prosqa_work: tuple[Path, list[str]], sets: list[str], says: str,
                                                    capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from pipelines.train import main as train_main

    wd, base = prosqa_work
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{wd / 'refused.db'}")
    code = train_main(["--config", RECIPE, "--workdir", str(wd), *base, *[f"--set={s}" for s in sets]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and says in err[0], err
    assert not (wd / "refused.db").exists()  # refused before the tracking store was touched


# ---- the evaluation: python -m pipelines.evaluate --suite accuracy on the registered version ------------------

@pytest.fixture(scope="module")
def acot_version(prosqa_work: tuple[Path, list[str]]) -> tuple[Path, str, dict]:
    """The toy fine-tuned and registered through the train command, once for this module's evaluation tests:
    (work directory, tracking URI, the command's JSON line)."""
    import contextlib
    import io

    from pipelines.train import main as train_main

    wd, sets = prosqa_work
    uri = f"sqlite:///{wd / 'eval-mlflow.db'}"
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        assert train_main(["--config", RECIPE, "--workdir", str(wd), *sets, "-q"]) == 0
    return wd, uri, json.loads(out.getvalue().strip().splitlines()[-1])


def test_accuracy_suite_scores_the_registered_version(acot_version: tuple[Path, str, dict],
                                                      capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow

    from pipelines.data.reasoning.answers import exact_match
    from pipelines.evaluate import main as evaluate_main
    from pipelines.evaluation.metrics import wilson_interval
    from pipelines.tracking.runs import client

    wd, uri, trained = acot_version
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert evaluate_main(["--model", "models:/acot-prosqa@candidate", "--suite", "accuracy", "--workdir", str(wd),
                          "--in-process", "--json", "-q"]) == 0
    got = json.loads(capsys.readouterr().out)
    m = got["metrics"]
    local = mlflow.artifacts.download_artifacts(run_id=got["run_id"], artifact_path="answers/validation.jsonl",
                                                tracking_uri=uri)
    records = [json.loads(x) for x in Path(local).read_text().splitlines()]
    assert len(records) == m["answer_total"] == 12 and all(r["correct"] == exact_match(r["generated"], r["gold"])
                                                           for r in records)
    share = sum(r["correct"] for r in records) / len(records)
    assert m["answer_accuracy"] == share and m["answer_correct"] == sum(r["correct"] for r in records)
    assert m["answer_accuracy_lo"] <= share <= m["answer_accuracy_hi"] and m["answer_accuracy_lo"] < m["answer_accuracy_hi"]
    assert (m["answer_accuracy_lo"], m["answer_accuracy_hi"]) == wilson_interval(int(m["answer_correct"]), 12)
    # the suite decodes as the fine-tuning scored its kept weights: the same answers, the version's accuracy again
    assert share == pytest.approx(trained["accuracy"])
    c = client(uri)
    run = c.get_run(got["run_id"])
    assert run.data.metrics["answer_accuracy_lo"] == m["answer_accuracy_lo"]
    tags = c.get_model_version("acot-prosqa", trained["registered_version"]).tags
    assert float(tags["answer_accuracy"]) == pytest.approx(share) and "wilson95=" in tags["answer_accuracy.settings"]
    assert tags["eval.run_id"] == got["run_id"]


def _corrupt(src: Path, dst: Path, name: str, key: str, value: str) -> Path:
    """A copy of folder ``src`` whose JSON file ``name`` has ``key`` (``a.b``) set to ``value``."""
    import shutil

    shutil.copytree(src, dst)
    obj = json.loads((dst / name).read_text())
    *path, last = key.split(".")
    node = obj
    for k in path:
        node = node[k]
    node[last] = value
    (dst / name).write_text(json.dumps(obj))
    return dst


def test_accuracy_suite_refuses_what_it_cannot_score(acot_version: tuple[Path, str, dict], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A diffusion kind and a split of language-model rows: one ``error:`` line, exit 2, before any weights load
    (the diffusion copy has no weight files at all)."""
    from pipelines.evaluate import main as evaluate_main

    wd, uri, trained = acot_version
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    ckpt = Path(trained["checkpoint_dir"])
    diffusion = _corrupt(ckpt, tmp_path / "mdlm", "config.json", "model.kind", "mdlm")
    for f in diffusion.iterdir():
        if f.suffix in (".safetensors", ".pt", ".bin"):
            f.unlink()
    lm_rows = _corrupt(wd / "data" / "prosqa-cpu" / "validation", tmp_path / "lm" / "validation", "manifest.json",
                       "mode", "wrap")
    for model, extra, says in [(str(diffusion), [], "diffusion kind"),
                               (str(ckpt), ["--set", f"accuracy_split={lm_rows}"], "not reasoning rows")]:
        code = evaluate_main(["--model", model, "--suite", "accuracy", "--workdir", str(wd), "--in-process", *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and says in err[0], err
