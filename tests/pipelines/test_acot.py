"""Anchored chain-of-thought: the layout (what is scored, where the anchors sit, stages), the objective
(masked positions contribute nothing, weight 0 is pause-as-thought exactly, the ``[ANT]`` outputs learn their
anchors only with weight > 0), the answer read after the last ``#`` and Wilson's interval."""

from __future__ import annotations

import math

import pytest
import torch

from adlm_model.config import ModelConfig
from adlm_model.kinds import build_model
from adlm_model.objectives.acot import IGNORE, acot_loss, anchor_accuracy, pause_as_thought_loss
from pipelines.data.reasoning.answers import exact_match, extract_answer
from pipelines.data.reasoning.layout import Markers, collate, lay_out
from pipelines.evaluation.metrics import wilson_interval

MK = Markers(bos=1, eos=2, pad=0, boa=3, eoa=4, ant=5, answer=(6,))


def test_layout_scores_only_what_is_generated() -> None:
    q, steps, ans, anchors = [10, 11, 12], [[20, 21], [22]], [30], [40, 41]
    laid = lay_out(q, steps, ans, anchors, MK, n_ant=3)
    assert laid.input_ids == [1, 10, 11, 12, 3, 5, 5, 5, 4, 20, 21, 22, 6, 30, 2]
    assert laid.prompt_len == 9
    scored = [laid.input_ids[p + 1] for p, t in enumerate(laid.sft_labels) if t != IGNORE]
    assert scored == [20, 21, 22, 6, 30, 2]  # the question, markers and [ANT] slots are never targets
    assert all(laid.sft_labels[p] == laid.input_ids[p + 1] for p in range(8, 14))
    # anchors at the i-th [ANT]; the third [ANT] has no anchor and no label
    assert [(p, a) for p, a in enumerate(laid.anchor_labels) if a != IGNORE] == [(5, 40), (6, 41)]
    before = lay_out(q, steps, ans, anchors, MK, n_ant=3, anchor_position="before")
    assert [(p, a) for p, a in enumerate(before.anchor_labels) if a != IGNORE] == [(4, 40), (5, 41)]
    staged = lay_out(q, steps, ans, anchors, MK, n_ant=1, removed_steps=1)  # ProsQA: a step less an [ANT]
    assert staged.input_ids == [1, 10, 11, 12, 3, 5, 4, 22, 6, 30, 2]
    no_cot = lay_out(q, steps, ans, anchors, MK, cot=False)
    assert no_cot.input_ids == [1, 10, 11, 12, 3, 4, 6, 30, 2]
    batch = collate([laid, staged], MK.pad)
    assert batch["input_ids"].shape == (2, 15) and batch["attention_mask"][1].sum() == 11
    assert (batch["sft_labels"][1, 10:] == IGNORE).all()


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = [lay_out([int(x) for x in torch.randint(10, 18, (3,), generator=g)], [[20]], [30], [40 + i % 3], MK,
                    n_ant=2) for i in range(6)]
    b = collate(rows, MK.pad)
    logits = torch.randn(6, b["input_ids"].shape[1], 50, generator=g)
    return logits, torch.as_tensor(b["sft_labels"]), torch.as_tensor(b["anchor_labels"])


def test_masked_positions_contribute_nothing() -> None:
    logits, sft, anchor = _batch()
    base = acot_loss(logits, sft, anchor, weight=0.7).loss
    unread = (sft == IGNORE) & (anchor == IGNORE)
    noisy = logits.clone()
    noisy[unread] += 5 * torch.randn_like(noisy[unread])
    assert torch.equal(acot_loss(noisy, sft, anchor, weight=0.7).loss, base)
    read = logits.clone()
    read[~unread] += 1.0 * torch.randn_like(read[~unread])
    assert not torch.allclose(acot_loss(read, sft, anchor, weight=0.7).loss, base)  # the test can fail


def test_weight_zero_is_pause_as_thought_exactly() -> None:
    logits, sft, anchor = _batch(1)
    out = acot_loss(logits, sft, anchor, weight=0.0)
    assert torch.equal(out.loss, pause_as_thought_loss(logits, sft))
    assert int(out.n_anchor) == 6 and int(out.n_sft) == 6 * 4  # one anchor a row (the second [ANT] has none); step, ###, answer, EOS
    with_anchor = acot_loss(logits, sft, anchor, weight=1.0)
    expected = out.sft_sum / out.n_sft + out.anchor_sum / out.n_anchor
    assert with_anchor.loss.item() == pytest.approx(expected.item(), rel=1e-6)


def _toy_accuracy(weight: float, steps: int = 250) -> float:
    """A tiny ``ar`` model on questions of 3 tokens: the anchor is the first question token, the answer the
    second (the trace is empty, so nothing but the anchor term trains the [ANT] output). Returns the [ANT]
    head's accuracy on fresh rows (chance: 1/8)."""
    torch.manual_seed(0)
    cfg = ModelConfig(kind="ar", vocab_size=24, mask_id=24, seq_len=16, hidden=32, heads=2, n_blocks=2,
                      cond_dim=16, dropout=0.0)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qs = torch.randint(8, 16, (n, 3), generator=g).tolist()
        b = collate([lay_out(q, [], [q[1]], [q[0]], MK, n_ant=1) for q in qs], MK.pad)
        return tuple(torch.as_tensor(b[k]) for k in ("input_ids", "sft_labels", "anchor_labels"))

    for _ in range(steps):
        x, sft, anchor = batch(32)
        loss = acot_loss(model(x), sft, anchor, weight=weight, exclude=cfg.mask_id).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    x, _, anchor = batch(512)
    with torch.no_grad():
        return anchor_accuracy(model(x), anchor)


def test_ant_outputs_learn_their_anchors_only_with_weight(one_torch_thread: None) -> None:
    with_anchor, without = _toy_accuracy(1.0), _toy_accuracy(0.0)
    assert with_anchor > 0.6  # chance is 1/8
    assert without < 0.3


def test_answer_extraction_and_exact_match() -> None:
    assert extract_answer("Tom is a terpus. ### Tom is a lempus.") == "Tom is a lempus."
    assert extract_answer("<<9*2=18>> #### 1,018 ") == "1018"
    assert exact_match("steps ### 18", "18") and not exact_match("steps ### 19", "18")
    assert exact_match("### True", "True") and not exact_match("True # False", "True")


def test_wilson_interval() -> None:
    lo, hi = wilson_interval(8, 10)
    assert (lo, hi) == (pytest.approx(0.4902, abs=1e-4), pytest.approx(0.9433, abs=1e-4))
    lo0, hi0 = wilson_interval(0, 20)
    assert lo0 == pytest.approx(0.0, abs=1e-12) and 0 < hi0 < 0.2  # not empty at zero successes
    assert wilson_interval(50, 100, level=0.99)[0] < wilson_interval(50, 100)[0]
    assert math.isclose(sum(wilson_interval(30, 60)), 1.0)  # symmetric about one half
    with pytest.raises(ValueError):
        wilson_interval(3, 0)
