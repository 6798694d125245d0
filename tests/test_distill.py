"""Self-distillation through time's objective (adlm_model/distill.py): the targets are the teacher's p_x0 at the
step where each position unmasked (or the last), a student equal to its teacher on a step that changes nothing has
zero loss, gradients reach the student only (both ADLM networks), and the rounds halve the steps."""

from __future__ import annotations

import copy

import pytest
import torch

from adlm_model.distill import divergence, round_steps, sdtt_loss, teacher_targets
from adlm_model.losses import subs_log_probs
from adlm_model.samplers import denoiser_fn
from tests.support_models import L, gen, micro, randomized

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rows(cfg, n: int = 6) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (n, L), generator=gen(11))


@pytest.mark.parametrize("kind", ["mdlm", "adlm"])
def test_targets_are_the_teachers_p_x0_where_each_position_unmasked(kind: str) -> None:
    cfg = micro(kind)
    teacher = randomized(cfg)
    z = _rows(cfg)
    z[torch.rand(z.shape, generator=gen(3)) < 0.7] = cfg.mask_id
    t = torch.full((z.shape[0],), 0.5)
    got = teacher_targets(teacher, cfg, z, t, dt=0.2, generator=gen(4))
    masked = z == cfg.mask_id
    assert ((got.step >= 0) == masked).all() and set(got.step[masked].tolist()) == {0, 1}
    assert torch.equal(got.states[0], z) and not torch.equal(got.states[1], z)
    with torch.no_grad():
        for k, state in enumerate(got.states):
            logp = subs_log_probs(denoiser_fn(teacher)(state, torch.zeros(z.shape[0])), state, cfg.mask_id)
            at = got.step == k
            torch.testing.assert_close(got.log_probs[at], logp[at])
    # The second step started where the first left: its masked positions are the ones not unmasked at step 0.
    assert torch.equal(got.states[1] == cfg.mask_id, masked & (got.step != 0))


@pytest.mark.parametrize("kind", ["mdlm", "adlm"])
def test_a_student_equal_to_its_teacher_on_unchanged_steps_has_zero_loss_and_only_it_learns(kind: str) -> None:
    cfg = micro(kind)
    teacher = randomized(cfg)
    student = copy.deepcopy(teacher).train()
    x = _rows(cfg)
    # dt tiny: the teacher's steps unmask nothing (up to 1e-12), so the target is its p_x0 on z_t itself.
    out = sdtt_loss(student, teacher, x, cfg, dt=1e-12, generator=gen(5))
    assert out.n_masked > 0 and abs(float(out.loss.detach())) < 1e-5
    other = randomized(cfg, seed=1).train()
    out = sdtt_loss(other, teacher, x, cfg, dt=0.05, generator=gen(5))
    assert float(out.loss.detach()) > 0.01
    out.loss.backward()
    assert all(p.grad is None for p in teacher.parameters())
    nets = [other.anchor, other.denoiser] if kind == "adlm" else [other.backbone]
    for net in nets:  # ADLM: the anchor network and the denoiser are both distilled
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())


def test_divergences_and_rounds() -> None:
    p = torch.log_softmax(torch.randn(5, 7, generator=gen(1)), -1)
    q = torch.log_softmax(torch.randn(5, 7, generator=gen(2)), -1)
    p[:, 3] = q[:, 3] = float("-inf")  # the SUBS mask column
    for kind in ("kl-bwd", "kl-fwd", "tvd"):
        assert torch.allclose(divergence(p, p, kind), torch.zeros(5), atol=1e-6)
        assert (divergence(q, p, kind) > 0).all()
    torch.testing.assert_close(divergence(q, p, "kl-bwd"), divergence(p, q, "kl-fwd"))
    assert round_steps(1024, 5) == [512, 256, 128, 64, 32]
    with pytest.raises(ValueError, match="do not split"):
        round_steps(24, 4)
