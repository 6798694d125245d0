"""The GPU path, for a machine with CUDA (skipped elsewhere; this repository's CI machine has no GPU, so these
have never run here: docs/operations/cluster.md says how to run them on a GPU node). Each checks the
CUDA result against the CPU one or a property that would catch a real bug: the model core's likelihood is the
CPU's, a bf16 training step (flash-attn when installed, else SDPA) lowers the loss with finite gradients, the
samplers keep their contracts on CUDA generators, and a checkpoint served with ``device="cuda"`` generates.

    python -m pytest -m gpu tests/model/test_gpu.py

On a GPU machine that has only torch (no pytest, no project install), ``benchmarks/gpu_check.py`` checks the same
ground and measures speed in one command (docs/operations/gpu.md).
"""

from __future__ import annotations

import pytest
import torch

from adlm_model import build_model, sample
from adlm_model.kinds import compute_loss
from tests.support.models import L, M, V, micro, randomized

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU on this machine)")]


def _rows(n: int = 8, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n, L), generator=g)


@pytest.mark.parametrize("kind", ["mdlm", "adlm", "ar", "bd3lm"])
def test_the_model_cores_bound_on_cuda_is_the_cpus(kind: str) -> None:
    """fp32 on both devices, the same fixed noise draw: the evaluation bound agrees to float32 rounding."""
    cfg = micro(kind)
    model = randomized(cfg)
    x = _rows()
    t = torch.full((x.shape[0],), 0.5)
    cpu = compute_loss(model, x, None, cfg, train=False, generator=torch.Generator().manual_seed(1), t=t)
    gpu = compute_loss(model.cuda(), x.cuda(), None, cfg, train=False,
                       generator=torch.Generator("cuda").manual_seed(1), t=t.cuda())
    assert torch.isfinite(gpu.loss) and gpu.loss.item() == pytest.approx(cpu.loss.item(), rel=1e-3)


@pytest.mark.parametrize("kind", ["mdlm", "adlm", "ar"])
def test_a_bf16_training_step_on_cuda_lowers_the_loss(kind: str) -> None:
    """Autocast bf16 (the GPU recipes' scaling.bf16), attention through flash-attn when importable, else SDPA:
    finite gradients, and ten AdamW steps on one batch (one fixed noise draw) lower its loss."""
    from adlm_model.nn.attention import flash_available

    cfg = micro(kind, hidden=64, heads=2)
    torch.manual_seed(0)
    model = build_model(cfg).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = _rows(16).cuda()
    losses = []
    for step in range(10):
        g = torch.Generator("cuda").manual_seed(0)  # the same noise draw every step: one fixed objective
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = compute_loss(model, x, None, cfg, step=step, generator=g)
        opt.zero_grad()
        out.loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0], losses
    q = torch.zeros(1, 4, 2, 32, device="cuda", dtype=torch.bfloat16)
    print(f"attention kernel: {'flash-attn' if flash_available(q) else 'SDPA'}")


@pytest.mark.parametrize("kind, sampler", [("mdlm", "mdlm"), ("mdlm", "remdm-loop"), ("adlm", "mdlm"),
                                           ("ar", "ar"), ("bd3lm", "bd3lm")])
def test_the_samplers_on_cuda_fill_every_mask_and_keep_the_prefix(kind: str, sampler: str) -> None:
    cfg = micro(kind)
    model = randomized(cfg).cuda()
    prefix = _rows(2)[:, :4].cuda()
    out = sample(model, cfg, batch_size=2, length=L, steps=8, sampler=sampler, prefix=prefix,
                 generator=torch.Generator("cuda").manual_seed(0))
    assert out.is_cuda and out.shape == (2, L)
    assert not (out == M).any() and int(out.max()) < V
    assert torch.equal(out[:, :4], prefix)
    again = sample(model, cfg, batch_size=2, length=L, steps=8, sampler=sampler, prefix=prefix,
                   generator=torch.Generator("cuda").manual_seed(0))
    assert torch.equal(out, again)  # the generator is the only source of randomness, on CUDA too


def test_a_checkpoint_served_on_cuda_generates(tmp_path) -> None:
    from pipelines.serving.generate import open_generator
    from tests.support.eval import make_data, save_ckpt, tiny_config

    data, tok, tok_path = make_data(tmp_path)
    cfg = tiny_config(tok, "mdlm")
    ckpt = save_ckpt(tmp_path / "ck", build_model(cfg), cfg, None, tok_path, data)
    gen = open_generator(str(ckpt), device="cuda").generator  # what pipelines.generate and the pyfunc model load
    assert gen.device.type == "cuda"
    out = gen.generate(gen.request(prompt="In the beginning", length=16, steps=8, seed=0, num_samples=2))
    assert len(out) == 2 and all(o.text.startswith("In the beginning") for o in out)
