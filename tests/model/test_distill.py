"""SDTT's objective (adlm_model/train/distill.py): zero when a one-step teacher is the student, a gradient to every
student parameter (ADLM: anchor network and denoiser), a target fixed by the generator's seed."""

from __future__ import annotations

import copy

import pytest
import torch

from adlm_model.objectives.schedule import mask_tokens
from adlm_model.train.distill import divergence, round_dt, sdtt_objective, student_steps, teacher_target
from tests.support.models import L, M, V, gen, micro, randomized


def _batch(seed: int = 0, b: int = 6) -> torch.Tensor:
    return torch.randint(0, V, (b, L), generator=gen(seed))


@pytest.mark.parametrize("kind", ["mdlm", "adlm"])
def test_one_step_teacher_equal_to_student_gives_zero(kind: str) -> None:
    cfg = micro(kind)
    teacher = randomized(cfg, seed=1)
    student = copy.deepcopy(teacher).train()  # training mode: ADLM's unfused path, the teacher's fused one
    for d in ("kl-bwd", "kl-fwd", "tvd", "mse"):
        out = sdtt_objective(student, teacher, _batch(), None, cfg, dt=0.25, substeps=1, divergence_kind=d,
                             generator=gen(3))
        assert int(out.n_tokens) > 0
        assert abs(float(out.loss.detach())) < 1e-5, (d, float(out.loss.detach()))
    # Two teacher steps: positions the second step decides carry another p_x0 than the student's one step.
    two = sdtt_objective(student, teacher, _batch(), None, cfg, dt=0.25, substeps=2, generator=gen(3))
    assert float(two.loss.detach()) > 1e-4


@pytest.mark.parametrize("kind", ["mdlm", "adlm"])
def test_gradient_reaches_every_student_parameter(kind: str) -> None:
    cfg = micro(kind)
    teacher = randomized(cfg, seed=1)
    student = randomized(cfg, seed=2).train()
    out = sdtt_objective(student, teacher, _batch(), None, cfg, dt=0.2, generator=gen(4))
    out.loss.backward()
    missing = [n for n, p in student.named_parameters() if p.grad is None or float(p.grad.abs().sum()) == 0.0]
    assert not missing, missing
    assert all(bool(torch.isfinite(p.grad).all()) for p in student.parameters())  # the -inf mask column
    assert all(p.grad is None for p in teacher.parameters())
    if kind == "adlm":
        names = [n for n, _ in student.named_parameters()]
        assert any(n.startswith("anchor.") for n in names) and any(n.startswith("denoiser.") for n in names)


def test_target_is_fixed_by_the_seed_and_is_the_teacher_p_x0_where_step_one_decides() -> None:
    cfg = micro("mdlm")
    teacher = randomized(cfg, seed=1)
    x = _batch()
    t = torch.full((x.shape[0],), 0.6)
    z_t, _ = mask_tokens(x, t[:, None], M, gen(5))
    a = teacher_target(teacher, cfg, z_t, t, 0.2, 2, gen(7))
    b = teacher_target(teacher, cfg, z_t, t, 0.2, 2, gen(7))
    c = teacher_target(teacher, cfg, z_t, t, 0.2, 2, gen(8))
    masked = z_t == M
    assert torch.equal(a[masked], b[masked])
    assert not torch.equal(a[masked], c[masked])
    # Each masked position's target is the teacher's p_x0 on z_t (decided at step one) or on the state after
    # step one: with a one-step teacher it is exactly the first.
    one = teacher_target(teacher, cfg, z_t, t, 0.2, 1, gen(7))
    first = torch.log_softmax(teacher.denoiser_logits(z_t, torch.zeros(x.shape[0])).float()
                              .index_fill(-1, torch.tensor([M]), float("-inf")), -1)
    assert torch.allclose(one[masked], first[masked], atol=1e-6)
    same = (a[masked] == one[masked]).all(-1)
    assert 0 < int(same.sum()) < int(masked.sum())  # some positions decided at step one, some later


def test_divergences_and_the_round_arithmetic() -> None:
    p = torch.log(torch.tensor([[0.5, 0.5, 0.0]]))
    q = torch.log(torch.tensor([[0.25, 0.75, 0.0]]))
    kl = 0.5 * torch.log(torch.tensor(2.0)) + 0.5 * torch.log(torch.tensor(0.5 / 0.75))
    assert torch.allclose(divergence(p, q, "kl-bwd"), kl.reshape(1))
    assert torch.allclose(divergence(p, q, "tvd"), torch.tensor([0.25]))
    assert float(divergence(p, p, "kl-fwd")) == 0.0
    with pytest.raises(ValueError, match="unknown divergence"):
        divergence(p, q, "js")
    assert student_steps(64, 3) == 8 and student_steps(64, 0) == 64
    assert round_dt(64, 1) == pytest.approx(2 * round_dt(64, 0))


def test_evaluation_samples_a_distilled_version_at_its_own_step_count_unless_told() -> None:
    from pipelines.evaluation.config import DEFAULT_EVAL_STEPS, EvalConfig, eval_profile, sampling_steps

    student = {"sampler_steps": 8}
    assert sampling_steps(EvalConfig(), "mdlm", student) == 8
    assert sampling_steps(EvalConfig(), "mdlm", {}) == DEFAULT_EVAL_STEPS
    assert sampling_steps(EvalConfig(steps=32), "mdlm", student) == 32  # the user's (or a profile's) T wins
    assert sampling_steps(eval_profile("paper"), "adlm", student) == 4096


def test_the_distill_command_is_a_train_recipe_and_refuses_bad_rounds_in_one_line(capsys) -> None:
    import yaml

    from pipelines.distill import main
    from tests.conftest import ROOT

    demo = str(ROOT / "configs" / "demo.yaml")
    assert main(["--teacher", "models:/adlm@candidate", "--config", demo, "--rounds", "2", "--steps-per-round", "5",
                 "--teacher-steps", "64", "--print-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["run"]["name"] == "distill-adlm-candidate" and cfg["run"]["init"] == "models:/adlm@candidate"
    assert cfg["run"]["max_steps"] == 10 and cfg["distill"]["teacher_steps"] == 64
    assert main(["--teacher", "models:/adlm/1", "--config", demo, "--rounds", "3", "--teacher-steps", "12"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: distill.teacher_steps 12 must divide by substeps**rounds = 8") and "\n" not in err
    assert main(["--teacher", "models:/adlm/1", "--config", demo, "--set", "model.kind=ar"]) == 2
    assert "SDTT distils the ancestral sampler of mdlm or adlm" in capsys.readouterr().err
