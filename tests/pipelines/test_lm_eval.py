"""The lm-eval adapter (pipelines/evaluation/lm_eval_*.py, adlm_model/inference/likelihood.py): exact AR log-likelihoods,
a Monte Carlo ELBO that converges to the exact conditional log-probability under an exact denoiser, the
offline tasks end to end through the harness (our suite and the harness's CLI), one-line errors before any
model loads."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from adlm_model import build_model
from adlm_model.inference.likelihood import ContinuationScorer, combine, mask_counts
from pipelines.evaluate import main
from pipelines.evaluation.config import EvalConfig
from pipelines.evaluation.run import evaluate_model
from tests.support.eval import make_data, register, save_ckpt, tiny_config, train_tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------------------------------------
# An exact oracle: a random joint distribution over every sequence of a tiny vocabulary.


class ToyLanguage:
    """p(x) over all V^L sequences (a Dirichlet draw); conditionals of any token given any visible tokens by
    enumeration: the exact denoiser of docs/design/method.md, section 1's any-order property."""

    def __init__(self, vocab: int = 3, length: int = 6, seed: int = 0) -> None:
        g = np.random.default_rng(seed)
        self.vocab, self.length, self.mask_id = vocab, length, vocab
        self.seqs = torch.tensor(list(itertools.product(range(vocab), repeat=length)))
        self.p = torch.from_numpy(g.dirichlet(np.full(len(self.seqs), 0.3)))

    def log_marginal(self, z: list[int]) -> float:
        """log P(visible tokens of z) (mask id: unknown)."""
        ok = torch.ones(len(self.seqs), dtype=torch.bool)
        for i, t in enumerate(z):
            if t != self.mask_id:
                ok &= self.seqs[:, i] == t
        return math.log(float(self.p[ok].sum()))

    def nll_fn(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """-log p(x^l | visible of z) at every masked position (0 elsewhere)."""
        out = torch.zeros(z.shape, dtype=torch.float64)
        for r in range(z.shape[0]):
            vis = torch.ones(len(self.seqs), dtype=torch.bool)
            for i, t in enumerate(z[r].tolist()):
                if t != self.mask_id:
                    vis &= self.seqs[:, i] == t
            base = float(self.p[vis].sum())
            for i in torch.nonzero(z[r] == self.mask_id).flatten().tolist():
                if x[r, i] != self.mask_id:
                    out[r, i] = -math.log(float(self.p[vis & (self.seqs[:, i] == x[r, i])].sum()) / base)
        return out


@pytest.mark.parametrize("scheme", ["plain", "antithetic", "stratified"])
def test_mc_elbo_with_an_exact_denoiser_converges_to_the_exact_conditional(scheme):
    toy = ToyLanguage()
    # Context 2 tokens, continuation 3, one unknown position after it (padding: the row is seq_len = 6 long).
    x = toy.seqs[int(torch.multinomial(toy.p.float(), 1, generator=torch.Generator().manual_seed(3)))].tolist()
    ctx, cont = x[:2], x[2:5]
    exact = toy.log_marginal(ctx + cont + [toy.mask_id]) - toy.log_marginal(ctx + [toy.mask_id] * 4)
    scorer = ContinuationScorer(seq_len=6, mask_id=toy.mask_id, nll_fn=toy.nll_fn, samples=512, scheme=scheme,
                                batch_size=512, greedy_max_tokens=0)
    [(est, _)] = scorer.score([(ctx, cont)], seeds=[1])
    assert est.samples == 512 and est.tokens == 3 and 0 < est.stderr < 0.2
    assert abs(est.loglik - exact) < 4 * est.stderr, (est, exact)
    # The same request, another seed: another estimate; a single-token continuation is exact in one draw.
    [(other, _)] = scorer.score([(ctx, cont)], seeds=[2])
    assert other.loglik != est.loglik
    [(one, _)] = scorer.score([(x[:4], x[4:5])], seeds=[0])
    exact1 = toy.log_marginal(x[:5] + [toy.mask_id]) - toy.log_marginal(x[:4] + [toy.mask_id] * 2)
    assert one.loglik == pytest.approx(exact1, abs=1e-9) and one.stderr == pytest.approx(0, abs=1e-9)


def test_mask_counts_and_standard_errors_follow_their_scheme():
    g = torch.Generator().manual_seed(0)
    strat = mask_counts(10, 10, "stratified", g)
    assert strat.tolist() == list(range(1, 11))  # one draw in each tenth of the masking rate
    anti = mask_counts(10, 8, "antithetic", g).view(-1, 2)
    assert (anti.sum(1) == 11).all()
    assert set(mask_counts(3, 200, "plain", g).tolist()) == {1, 2, 3}
    draws = torch.tensor([1.0, 3.0, 2.0, 2.0])
    assert combine(draws, "plain") == pytest.approx((2.0, float(draws.std()) / 2))
    assert combine(draws, "antithetic") == pytest.approx((2.0, 0.0))  # both pair means are 2
    assert combine(draws, "stratified") == pytest.approx((2.0, math.sqrt(4.0) / 4))


# ----------------------------------------------------------------------------------------------------------
# Real checkpoints.


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    root = tmp_path_factory.mktemp("lmeval")
    data, tok, tok_path = make_data(root)
    from pipelines.data.reader import read_rows

    rows, _ = read_rows(str(data / "train"))
    out = {"root": root, "data": data, "tok": tok}
    for kind, steps in (("ar", 30), ("mdlm", 30), ("a2r", 30)):
        cfg = tiny_config(tok, kind)
        model, ema = train_tiny(cfg, rows, steps)
        out[kind] = save_ckpt(root / f"ck-{kind}", model, cfg, ema, tok_path, data, step=steps)
    return out


@pytest.mark.parametrize("kind", ["ar", "a2r"])
def test_ar_loglikelihood_is_the_direct_sum_of_token_log_probabilities(art, kind: str):
    """AR and A2R (exact likelihoods): each continuation's log-likelihood is the sum of its tokens' next-token
    log-probabilities from one pass of the network."""
    from lm_eval.api.instance import Instance

    from adlm_model import load_checkpoint
    from pipelines.evaluation.lm_eval_model import ADLMEvalLM

    lm = ADLMEvalLM(pretrained=str(art[kind]))
    pairs = [("In the beginning God created", " the heaven and the earth."), ("And God said, Let there", " be light")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True)
    model, cfg, _ = load_checkpoint(art[kind])
    assert cfg.kind == kind
    tok = art["tok"]
    for (ctx, cont), (ll, greedy) in zip(pairs, got, strict=True):
        c, y = tok.encode([ctx])[0], tok.encode([ctx + cont])[0][len(tok.encode([ctx])[0]):]
        ids = [tok.bos_id] + c + y
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0].double()
        logits[:, cfg.mask_id] = -math.inf
        logp = torch.log_softmax(logits, -1)
        direct = sum(float(logp[i - 1, ids[i]]) for i in range(1 + len(c), len(ids)))
        assert ll == pytest.approx(direct, abs=1e-4) and ll < 0
        assert greedy == all(int(logp[i - 1].argmax()) == ids[i] for i in range(1 + len(c), len(ids)))
    assert all(s["samples"] == 0 and s["stderr"] == 0 for s in lm.stats)  # exact: no Monte Carlo
    # loglikelihood_rolling: the document framed as a training row (BOS doc EOS): log p(doc | BOS) from
    # loglikelihood plus log p(EOS | BOS doc).
    doc = "And the evening and the morning were the first day."
    [rolling] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (doc,), 0)], disable_tqdm=True)
    [(ll, _)] = lm.loglikelihood([Instance("loglikelihood", {}, ("", doc), 0)], disable_tqdm=True)
    ids = [tok.bos_id, *tok.encode([doc])[0]]
    with torch.no_grad():
        last = model(torch.tensor([ids]))[0, -1].double()
    last[cfg.mask_id] = -math.inf
    assert rolling == pytest.approx(ll + float(torch.log_softmax(last, -1)[tok.eos_id]), abs=1e-4)


def test_generate_until_runs_every_sampler_of_every_kind(art, tmp_path):
    """``generate_until`` with every sampler the adapter offers a kind (``auto`` and each of ``samplers_for``),
    a tiny model of each kind (the trained AR and MDLM, the others as initialised): text after the context, cut at
    the stop sequence, the same for the same request; the AR's ``bos_id`` option reached infill only once (it
    raised ``got multiple values for keyword argument 'bos_id'``). A sampler of another kind is refused in one line
    when the adapter is made."""
    from lm_eval.api.instance import Instance

    from adlm_model.kinds import KINDS, samplers_for
    from pipelines.evaluation.config import EvalError
    from pipelines.evaluation.lm_eval_model import ADLMEvalLM

    tok = art["tok"]
    tok_path = art["root"] / "data" / "tokenizer.json"
    request = Instance("generate_until", {}, ("In the beginning God", {"until": ["."], "max_gen_toks": 5}), 0)
    ran = []
    for kind in KINDS:
        ckpt = art.get(kind)
        if ckpt is None:
            torch.manual_seed(1)
            model = build_model(tiny_config(tok, kind, block_size=4))
            ckpt = save_ckpt(tmp_path / kind, model, tiny_config(tok, kind, block_size=4), None, tok_path, art["data"])
        if KINDS[kind].sample_only:  # no likelihood for the harness's tasks: refused in one line when made
            with pytest.raises(EvalError, match=f"model kind {kind} is sample-only") as e:
                ADLMEvalLM(pretrained=str(ckpt))
            assert "\n" not in str(e.value)
            continue
        for sampler in ["auto", *samplers_for(kind)]:
            lm = ADLMEvalLM(pretrained=str(ckpt), sampler=sampler, steps=2, max_gen_toks=5)
            [text] = lm.generate_until([request], disable_tqdm=True)
            assert isinstance(text, str) and "." not in text, (kind, sampler, text)
            assert lm.generate_until([request], disable_tqdm=True) == [text], (kind, sampler)
            ran.append((kind, sampler))
    assert ("ar", "ar") in ran and ("bd3lm", "bd3lm") in ran and ("sedd", "sedd-euler") in ran and len(ran) >= 20
    with pytest.raises(EvalError, match="sampler 'sedd-euler' does not run on a mdlm model; it takes remdm-loop"):
        ADLMEvalLM(pretrained=str(art["mdlm"]), sampler="sedd-euler")


def test_offline_tasks_run_through_the_harness_and_log_figures_with_stderrs(art, workdir, capsys):
    import mlflow

    tracking = f"sqlite:///{workdir / 'mlflow.db'}"
    mv = register(art["mdlm"], tracking)
    cfg = EvalConfig(lm_eval_limit=3, lm_eval_mc_samples=4, steps=4)
    with forks_recorded() as forks:
        r = evaluate_model("models:/adlm@candidate", "lm-eval", cfg, in_process=True)
    # The perplexity's bootstrap stderr is computed (below) without the harness's process pool: a fork of a
    # multi-threaded Ray worker can deadlock.
    assert forks == [], "the lm-eval suite forked"
    m = r.metrics
    for key in ("adlm_lastword.acc", "adlm_lastword.perplexity", "adlm_choice.acc", "adlm_choice.acc_norm",
                "adlm_generate.exact_match"):
        assert f"lm_eval.{key}" in m and f"lm_eval.{key}_stderr" in m, key
    assert 0 <= m["lm_eval.adlm_choice.acc"] <= 1 and m["lm_eval.adlm_lastword.perplexity"] > 1
    assert m["lm_eval.adlm_choice.mc_samples"] == 4 and m["lm_eval.adlm_choice.mc_stderr"] > 0
    client = mlflow.MlflowClient(tracking)
    logged = client.get_run(r.run_id).data.metrics
    assert logged["lm_eval.adlm_choice.acc"] == pytest.approx(m["lm_eval.adlm_choice.acc"])
    tags = client.get_model_version("adlm", mv.version).tags
    assert tags["lm_eval.adlm_choice.acc"].startswith(f"{m['lm_eval.adlm_choice.acc']:.6g} ± ")
    assert "mc_samples=4 mask_draws=stratified" in tags["lm_eval.settings"]
    assert any(row["quantity"] == "lm-eval adlm_choice acc" and "4 stratified draws" in row["details"]
               for row in r.table)
    # the generative task is labelled with how its answers were made, not as log-likelihoods
    [gen_row] = [row for row in r.table if row["quantity"] == "lm-eval adlm_generate exact_match"]
    assert "generated by the remdm-loop sampler, T=4" in gen_row["details"] and "log-likelihood" not in gen_row["details"]
    # A missing version through the harness's CLI: one line naming what exists, no traceback.
    from pipelines.evaluation.lm_eval_cli import main as cli

    capsys.readouterr()
    assert cli(["--model", "adlm", "--model_args", "pretrained=models:/adlm/99", "--tasks", "adlm_lastword"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        f"error: registered model 'adlm' has no version 99 in {tracking} (it has versions 1; aliases candidate=1): "
        "name one of those, or pass a checkpoint directory (the MLflow UI lists every model: mlflow ui "
        "--backend-store-uri TRACKING_URI)"), err


_FORKS: list[int] | None = None


def _record_fork() -> None:
    if _FORKS is not None:
        _FORKS.append(os.getpid())


os.register_at_fork(before=_record_fork)  # only records while forks_recorded() is open (hooks cannot be removed)


@contextlib.contextmanager
def forks_recorded() -> Iterator[list[int]]:
    """The os.fork() calls of this process while inside (multiprocessing's default start on Linux forks)."""
    global _FORKS
    _FORKS = []
    try:
        yield _FORKS
    finally:
        _FORKS = None


def test_the_suite_runs_five_times_in_a_row_under_ray_and_a_job_past_its_deadline_fails_in_one_line(
        art, workdir, ray_session, capsys):
    """The hang seen in 1 of 6 runs (the harness forked a pool from the Ray worker) needs repetition to show;
    each run here is one task of two documents on the session's Ray, every run under a deadline."""
    cfg = EvalConfig(lm_eval_tasks=("adlm_lastword",), lm_eval_limit=2, lm_eval_mc_samples=2, steps=4,
                     cpus_per_task=0.5, job_timeout_s=120)
    figures = [evaluate_model(str(art["mdlm"]), "lm-eval", cfg, log=False).metrics for _ in range(5)]
    assert all(m["lm_eval.adlm_lastword.perplexity"] > 1 and "lm_eval.adlm_lastword.perplexity_stderr" in m
               for m in figures)
    assert all(m == figures[0] for m in figures)  # seeded: the same figures every time
    t0 = time.monotonic()
    assert main(["--model", str(art["mdlm"]), "--suite", "lm-eval", "--tasks", "adlm_lastword", "--set",
                 "lm_eval_limit=2", "--set", "lm_eval_mc_samples=2", "--set", "cpus_per_task=0.5", "--set",
                 "job_timeout_s=0.05"]) == 1
    assert time.monotonic() - t0 < 60
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(err) == 1, err
    assert (f"evaluation of {art['mdlm']}, suite lm-eval: lm-eval (adlm_lastword): 1 of 1 Ray task(s) still running"
            in err[0] and "job_timeout_s" in err[0] and "cancelled" in err[0]), err


def test_the_harness_cli_runs_the_adlm_model(art, tmp_path, capsys):
    from pipelines.evaluation.lm_eval_cli import main as cli

    out = tmp_path / "out"
    assert cli(["--model", "adlm", "--model_args", f"pretrained={art['ar']}", "--tasks", "adlm_lastword",
                "--limit", "3", "--output_path", str(out)]) == 0
    [result] = list(out.rglob("results_*.json"))
    res = json.loads(result.read_text())["results"]["adlm_lastword"]
    assert "acc,none" in res and "perplexity,none" in res


def test_bad_tasks_and_settings_fail_in_one_line_before_a_model_loads(art, capsys, tmp_path):
    from pipelines.evaluation.lm_eval_cli import main as cli

    missing = str(tmp_path / "nothing")  # no model here: a load would fail differently
    for argv, msg in (
        (["--suite", "lm-eval", "--tasks", "adlm_lastwrd"], "unknown lm-eval task adlm_lastwrd (close: adlm_lastword"),
        (["--suite", "lm-eval", "--set", "lm_eval_mask_draws=sobol"], "mask draws 'sobol': use one of plain"),
        (["--suite", "lm-eval", "--set", "lm_eval_mc_samples=5"], "use an even number of samples, got 5"),
    ):
        assert main(["--model", missing, *argv]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
        assert len(err) == 1 and msg in err[0], err
    assert cli(["--model", "adlm", "--model_args", f"pretrained={missing},mc_samples=3", "--tasks", "adlm_offline"]) == 2
    assert "even number of samples" in capsys.readouterr().err
    assert cli(["--model", "adlm", "--model_args", f"pretrained={missing},colour=red", "--tasks", "adlm_offline"]) == 2
    assert "colour" in capsys.readouterr().err


@pytest.mark.parametrize("scheme", ["plain", "stratified"])
def test_on_the_testbed_the_adapter_converges_to_the_exact_conditional_within_its_stderr(scheme):
    """The adapter's scorer with the testbed's exact conditionals as the denoiser (an oracle: docs/design/method.md
    section 1's any-order property makes every ordering exact) gives log p(continuation | context) of the
    generator within its reported standard error, and the error shrinks as 1/sqrt(samples)."""
    from adlm_model.testbed.language import BOS_ID, MASK_ID, Testbed, TestbedConfig

    tb = Testbed(TestbedConfig(length=24))

    def oracle(z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        logp = tb.conditionals(z, MASK_ID)
        return -logp.gather(-1, x.clamp(max=logp.shape[-1] - 1)[..., None]).squeeze(-1)

    row = tb.sample(1, seed=5)[0]
    ctx, cont = row[1:10].tolist(), row[10:18].tolist()  # the rest of the row (and its EOS) stays unknown
    z_joint = torch.full((1, 24), MASK_ID)
    z_joint[0, :18] = row[:18]
    z_ctx = z_joint.clone()
    z_ctx[0, 10:] = MASK_ID
    exact = float(tb.log_marginal(z_joint, MASK_ID) - tb.log_marginal(z_ctx, MASK_ID))
    got = {}
    for k in (64, 256):
        scorer = ContinuationScorer(seq_len=24, mask_id=MASK_ID, bos_id=BOS_ID, nll_fn=oracle, samples=k,
                                    scheme=scheme, batch_size=256, greedy_max_tokens=0)
        [(est, _)] = scorer.score([(ctx, cont)], seeds=[7])
        assert abs(est.loglik - exact) < 4 * est.stderr + 1e-9, (k, est, exact)
        got[k] = est
    assert 1.3 < got[64].stderr / got[256].stderr < 3.2  # ~2: the standard error falls as 1/sqrt(samples)
    assert abs(got[256].loglik - exact) < 0.05 * abs(exact)

    def blind(z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # ignores every visible token: not exact
        return oracle(torch.where(torch.arange(24) == 0, z, MASK_ID).expand_as(z).contiguous(), x)

    scorer = ContinuationScorer(seq_len=24, mask_id=MASK_ID, bos_id=BOS_ID, nll_fn=blind, samples=64, scheme=scheme,
                                batch_size=256, greedy_max_tokens=0)
    [(worse, _)] = scorer.score([(ctx, cont)], seeds=[7])
    assert worse.loglik < exact - 4 * worse.stderr  # an imperfect denoiser: a strictly lower bound


def test_lm_eval_figures_reach_the_model_card_and_the_summary_from_the_suites_table() -> None:
    """A figure is described once, by its suite (``suites.Figure``): the model card and the pipeline's summary
    list lm-eval's task figures as they list the perplexity, with the definition and the settings the suite gives."""
    from adlm_model.config import ModelConfig
    from pipelines.evaluation.suites import SUITES
    from pipelines.orchestration.summary import summary_markdown
    from pipelines.serving.export import _Source, model_card

    tags = {"val_ppl": "812.5", "lm_eval.piqa.acc": "0.52 ± 0.05", "lm_eval.arc_easy.acc_norm": "0.31 ± 0.04",
            "lm_eval.settings": "tasks=piqa,arc_easy limit=100 fewshot=task mc_samples=4 mask_draws=1 seed=0"}
    cfg = ModelConfig(kind="mdlm", vocab_size=64, mask_id=63, seq_len=16, hidden=32, heads=2, n_blocks=1, cond_dim=16)
    card = model_card(_Source("models:/adlm/3", "/nowhere", name="adlm", version="3", tags=tags), cfg, {}, 1000)
    lm_eval = SUITES["lm-eval"].figures[0]
    assert "| lm-eval piqa.acc (`lm_eval.piqa.acc`) | 0.52 ± 0.05 | lm_eval.settings: tasks=piqa,arc_easy" in card
    assert "| lm-eval arc_easy.acc_norm (`lm_eval.arc_easy.acc_norm`) | 0.31 ± 0.04 |" in card
    assert lm_eval.definition in card and "| Validation perplexity (`val_ppl`) | <= 812.5 |" in card
    assert "lm_eval.settings (`" not in card  # the settings tag is no figure
    row = {"model": "MDLM", "version": "3", "kind": "mdlm", "gamma": None, "tau": None, "val_ppl": 812.5,
           "gen_ppl": None, "entropy": None, "mauve": None, "gen_ppl_definition": None, "status": "promoted",
           "champion": True, "families": {lm_eval.tag: {"arc_easy.acc_norm": "0.31 ± 0.04", "piqa.acc": "0.52 ± 0.05"}}}
    md = summary_markdown({"profile": "demo", "model_name": "adlm", "champion": "3", "rows": [row], "timings_s": {},
                           "tracking_uri": "sqlite:///x", "comparable": False})
    assert "| validation PPL (bound) | entropy | gen-PPL | MAUVE | lm-eval | status |" in md
    assert "| <= 812.500 | - | - | - | arc_easy.acc_norm 0.31 ± 0.04; piqa.acc 0.52 ± 0.05 | promoted **champion** |" in md
