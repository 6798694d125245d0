"""The anchored autoregressive model (docs/design/method.md, section 3): an AR model when its anchor is cut off, causal
through both networks, an objective equal to its formula, cached sampling equal to recomputation, and a FLOP count
equal to the hand count."""

from __future__ import annotations

import pytest
import torch

from adlm_model import ConfigError, build_model, compute_loss, sample
from adlm_model.objectives.losses import anchor_mask, anchor_targets, materialised_logits, suppress_mask
from adlm_model.train.flops import training_flops_per_row
from tests.support.models import L, V, gen, micro, randomized


def _rows(n: int = 3, seed: int = 1) -> torch.Tensor:
    """Rows over a few tokens with a handful of rare ones, so that tau = 2 makes some positions anchors and not
    others."""
    g = gen(seed)
    x = torch.randint(0, 6, (n, L), generator=g)
    rare = torch.rand(n, L, generator=g) < 0.15
    return torch.where(rare, torch.randint(6, V, (n, L), generator=g), x)


def _reference_targets(x: torch.Tensor, am: torch.Tensor | None, tau: int, mode: str
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The anchor targets by their definition, position by position."""
    a = anchor_mask(x, am, tau, V + 1)
    target, has = torch.zeros_like(x), torch.zeros_like(x, dtype=torch.bool)
    for r in range(x.shape[0]):
        for pos in range(x.shape[1]):
            if am is not None and not am[r, pos]:
                continue
            later = [j for j in range(pos + 1, x.shape[1]) if a[r, j]]
            if mode == "next_token":
                later = later[:1] if later and later[0] == pos + 1 else []
            if later:
                target[r, pos], has[r, pos] = x[r, later[0]], True
    return target, has


@pytest.mark.parametrize("mode", ["next_anchor", "next_token"])
def test_anchor_targets_follow_their_definition(mode: str) -> None:
    x = _rows()
    am = torch.ones_like(x)
    am[1, -5:] = 0  # a padded row: pads are no anchors and no positions
    cfg = micro("a2r", tau=2, anchor_target=mode)
    target, has = anchor_targets(x, am, cfg)
    ref_target, ref_has = _reference_targets(x, am, 2, mode)
    assert torch.equal(has, ref_has) and 0 < int(has.sum()) < has.numel()
    assert torch.equal(target[has], ref_target[has])


def _ar_twin(model: torch.nn.Module, cfg) -> tuple[torch.nn.Module, object]:
    """An ``ar`` model of the A2R's AR depth carrying its AR model's weights."""
    ar_cfg = cfg.replace(kind="ar", n_blocks=cfg.denoiser_blocks)
    ar = build_model(ar_cfg).eval()
    ar.backbone.load_state_dict(model.lm.state_dict())
    return ar, ar_cfg


def test_with_its_anchor_cut_off_it_is_the_ar_model() -> None:
    """gamma = 0 and the projection of the anchor logits zeroed: the A2R's training loss and evaluation bound are the
    ``ar`` kind's NLL on the AR model's weights; with the projection in place they are not."""
    cfg = micro("a2r", gamma=0.0)
    model = randomized(cfg)
    x = _rows()
    ar, ar_cfg = _ar_twin(model, cfg)
    expected = compute_loss(ar, x, None, ar_cfg, train=False).nll_sum
    assert not torch.allclose(compute_loss(model, x, None, cfg, train=False).nll_sum, expected)
    with torch.no_grad():
        model.projection.weight.zero_()
        model.projection.bias.zero_()
    for train in (True, False):
        model.train(train)
        out = compute_loss(model, x, None, cfg, train=train, step=5)
        torch.testing.assert_close(out.nll_sum, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out.loss.double(), expected / out.n_tokens, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [True, False])
def test_the_training_loss_is_the_nll_plus_gamma_times_the_anchor_cross_entropy(fused: bool) -> None:
    """Against the formula computed from the two networks' logits: sum of -log p(x^{l+1}) over the targets (the mask
    column out, as AR's) plus
    gamma_k sum of -log softmax(y_phi^l)[x^{j(l)}] where l has an anchor target, over the next-token targets; the
    ramp's gamma_k at the step; evaluation reports the NLL alone."""
    cfg = micro("a2r", tau=2, gamma=0.5, gamma_beta=1.0, gamma_horizon=100)
    model = randomized(cfg).train()
    x = _rows()
    am = torch.ones_like(x)
    am[2, -4:] = 0
    ctx = materialised_logits() if not fused else torch.enable_grad()
    with ctx:
        out = compute_loss(model, x, am, cfg, train=True, step=20)
    with torch.no_grad():
        logits = suppress_mask(model(x, fused=False), cfg.mask_id).double().log_softmax(-1)  # never the mask
        anchor = model.anchor_logits(x).double().log_softmax(-1)
    valid = am[:, 1:].bool()
    nll = -(logits[:, :-1].gather(-1, x[:, 1:, None]).squeeze(-1) * valid).sum()
    target, has = _reference_targets(x, am, 2, "next_anchor")
    ce = -(anchor.gather(-1, target[..., None]).squeeze(-1) * has).sum()
    assert out.gamma_k == pytest.approx(0.2)
    torch.testing.assert_close(out.nll_sum, nll, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.anchor_sum, ce, rtol=1e-5, atol=1e-5)
    assert int(out.n_tokens) == int(valid.sum()) and int(out.n_anchor) == int(has.sum())
    torch.testing.assert_close(out.loss.double(), (nll + 0.2 * ce) / valid.sum(), rtol=1e-5, atol=1e-6)
    out.loss.backward()
    assert model.anchor.blocks[0].attn_qkv.weight.grad.abs().sum() > 0  # end to end: the anchor trains
    evaluated = compute_loss(model.eval(), x, am, cfg, train=False)
    assert evaluated.anchor_sum is None
    torch.testing.assert_close(evaluated.nll_sum, nll, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("embedding", [True, False])
def test_no_position_sees_a_later_token(embedding: bool) -> None:
    """Token l + 1 changed: the anchor logits and the next-token logits (training path and fused path) at positions
    <= l stay, and those at l + 1 move."""
    cfg = micro("a2r", ar_token_embedding=embedding)
    model = randomized(cfg)
    x = _rows(2)
    for pos in (0, 7, L - 2):
        y = x.clone()
        y[:, pos + 1] = (y[:, pos + 1] + 5) % V
        with torch.no_grad():
            for fn in (model.anchor_logits, lambda t: model(t, fused=False), lambda t: model(t, fused=True)):
                a, b = fn(x), fn(y)
                torch.testing.assert_close(a[:, :pos + 1], b[:, :pos + 1], rtol=1e-5, atol=1e-5)
                assert (a[:, pos + 1] - b[:, pos + 1]).abs().max() > 1e-4


def test_the_fused_projection_equals_the_two_layers() -> None:
    cfg = micro("a2r")
    model = randomized(cfg)
    x = _rows(2)
    with torch.no_grad():
        torch.testing.assert_close(model(x, fused=True), model(x, fused=False), rtol=1e-4, atol=1e-4)


def _pass_lengths(model: torch.nn.Module) -> tuple[list[int], list[int], list]:
    anchor, lm = [], []
    hooks = [model.anchor.blocks[0].register_forward_pre_hook(lambda m, a: anchor.append(a[0].shape[1])),
             model.lm.blocks[0].register_forward_pre_hook(lambda m, a: lm.append(a[0].shape[1]))]
    return anchor, lm, hooks


@pytest.mark.parametrize("embedding", [True, False])
def test_cached_sampling_equals_recomputation_with_one_pass_of_each_network_a_token(embedding: bool) -> None:
    """The ``ar`` sampler on an A2R: the KV cache through both networks gives the recomputed tokens at the same seed;
    after the prompt's pass each network runs once per new token, on that token alone."""
    cfg = micro("a2r", ar_token_embedding=embedding)
    model = randomized(cfg)
    prompt = torch.tensor([0, 3, 9, 1])
    runs = {}
    for cache in (True, False):
        stats: dict = {}
        anchor, lm, hooks = _pass_lengths(model)
        runs[cache] = sample(model, cfg, batch_size=3, length=L, steps=1, sampler="ar", nucleus_p=0.9,
                             generator=gen(4), prefix=prompt, cache=cache, stats=stats)
        for h in hooks:
            h.remove()
        assert stats["network_calls"] == L - len(prompt)
        if cache:
            assert anchor == lm == [len(prompt)] + [1] * (L - len(prompt) - 1)
        else:
            assert anchor == lm == list(range(len(prompt), L))
    assert torch.equal(runs[True], runs[False])
    assert torch.equal(runs[True][:, :4], prompt.expand(3, 4))
    assert len({tuple(r) for r in runs[True].tolist()}) > 1  # the rows are drawn, not copied


def test_the_flop_count_is_the_hand_count() -> None:
    """Per row of L tokens: 6 x (weights) x (tokens) for every matmul (forward, input and weight gradients), the
    blocks' 12 h^2 weights and their attention (14 L^2 h), the anchor's output layer and the projection over L
    positions, the AR model's output layer over the L - 1 targets; the token embedding is a lookup."""
    cfg = micro("a2r", seq_len=32)
    length, h, width = cfg.seq_len, cfg.hidden, cfg.width
    block = 72 * h * h * length + 14 * length * length * h
    hand = (cfg.n_blocks + cfg.denoiser_blocks) * block + 12 * h * width * length + 6 * h * width * (length - 1)
    assert training_flops_per_row(cfg) == hand
    ar = training_flops_per_row(cfg.replace(kind="ar"))
    assert ar == cfg.n_blocks * block + 6 * h * width * (length - 1)


def test_a_bad_anchor_target_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as e:
        micro("a2r", anchor_target="next")
    assert "anchor_target must be one of next_anchor, next_token" in str(e.value) and "\n" not in str(e.value)
