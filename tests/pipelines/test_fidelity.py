"""Conventions around the formulas that change published numbers (docs/design/method.md, the references): which tags a
registered version carries per model kind, the ``paper`` evaluation profile, and BD3-LM's clipped-schedule
choice on a case whose answer is known."""

from __future__ import annotations

import pytest
import torch

from adlm_model.config import MODEL_KINDS, ModelConfig


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_only_anchored_versions_carry_gamma_and_tau(kind: str) -> None:
    """An MDLM, AR or BD3-LM version has no anchor loss to describe: tagging it with gamma/tau would put it in
    a gamma/tau comparison it does not belong to; ADLM and A2R train with the anchor term."""
    from pipelines.tracking.registry import training_tags

    tags = training_tags(ModelConfig(kind=kind, gamma=0.01, tau=7), run_name="r")
    assert tags["kind"] == kind and tags["run_name"] == "r"
    if kind in ("adlm", "a2r"):
        assert (tags["gamma"], tags["tau"]) == (0.01, 7)
    else:
        assert "gamma" not in tags and "tau" not in tags


def test_the_paper_profile_holds_the_references_evaluation_settings() -> None:
    """docs/design/method.md, sections 4 and 6: ReMDM-loop (each diffusion kind's default sampler), T = 4096 for ADLM and
    1024 for the baselines, nucleus p = 0.9, 5,000 samples for MAUVE, gpt2-large, the first token scored."""
    from pipelines.evaluation.config import eval_profile, resolve_sampler

    p = eval_profile("paper")
    assert p.profile == "paper" and p.sampler == "auto"
    steps = {k: p.steps_by_kind.get(k, p.steps) for k in MODEL_KINDS}
    assert steps == {"mdlm": 1024, "adlm": 4096, "ar": 1024, "bd3lm": 1024, "sedd": 1024, "ssdlm": 1000, "a2r": 1024}
    assert resolve_sampler(p.sampler, "sedd") == "sedd-analytic"  # the SEDD reference's run_sample predictor
    assert resolve_sampler(p.sampler, "adlm") == resolve_sampler(p.sampler, "mdlm") == "remdm-loop"
    assert (p.nucleus_p, p.num_samples, p.eval_lm, p.mauve_featurizer) == (0.9, 5000, "gpt2-large", "gpt2-large")
    assert p.gen_ppl_first_token == "keep" and p.use_ema
    demo = eval_profile("demo")
    assert demo.num_samples < 100 and demo.eval_lm != "gpt2-large"  # a wiring check, not the papers' settings


def _moments(cells: list[list[float]]) -> torch.Tensor:
    t = [torch.tensor(c, dtype=torch.float64) for c in cells]
    return torch.stack([torch.stack([torch.tensor(float(len(c)), dtype=torch.float64), c.sum(), (c * c).sum()])
                        for c in t])


def test_the_clipped_schedule_is_the_interval_of_least_variance() -> None:
    """Pooled moments (count, sum, sum of squares) of known per-block losses: the choice is the interval whose
    cells vary least, and the reported variances are the unbiased sample variances."""
    from adlm_model.baselines.bd3lm import choose_clip
    from adlm_model.sampling.samplers import SamplerError

    intervals = [(1e-3, 1.0), (0.3, 0.8), (0.5, 0.6)]
    cells = [[1.0, 9.0, 2.0, 14.0], [4.0, 5.0, 4.5, 5.5], [3.0, 7.0, 3.0, 7.0]]
    res = choose_clip(_moments(cells), intervals)
    assert (res.beta, res.omega) == (0.3, 0.8)
    for iv, c in zip(intervals, cells, strict=True):
        assert res.variances[iv] == pytest.approx(torch.tensor(c, dtype=torch.float64).var().item(), rel=1e-12)
    # Moments of two workers add up to the moments of all their cells (an all-reduce, then the choice).
    halves = _moments([c[:2] for c in cells]) + _moments([c[2:] for c in cells])
    assert choose_clip(halves, intervals).variances == pytest.approx(res.variances, rel=1e-12)
    with pytest.raises(SamplerError, match="at least two"):
        choose_clip(_moments([[1.0], [1.0, 2.0], [1.0, 2.0]]), intervals)


def test_the_zero_shot_sets_keep_their_empty_rows_by_default() -> None:
    """The reference's zero-shot loader appends EOS to every row, empty rows (WikiText's blank lines) included:
    every named zero-shot source keeps them unless ``--no-keep-empty``; the training corpora drop them."""
    from pipelines.data.sources import NAMED_SOURCES

    training = {"openwebtext", "lm1b"}
    assert training < set(NAMED_SOURCES)
    for name, src in NAMED_SOURCES.items():
        assert src.keep_empty is (name not in training), name
