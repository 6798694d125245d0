"""How much the mask-count draws of the adapter's Monte Carlo ELBO cut its variance (adlm_model/inference/likelihood.py).

On the testbed (adlm_model/testbed/language.py: a synthetic language with exact conditionals, used as an oracle
denoiser), the log-likelihood of continuations given their context is estimated ``--repeats`` times with
``--samples`` draws each, for plain, antithetic and stratified mask counts. Printed per scheme: the spread of
the estimates over repeats (their true standard error), the mean reported standard error (is it honest?) and
the bias against the exact value; then the variance ratios against plain draws.

    python benchmarks/lm_eval_mc_variance.py --samples 32 --repeats 40
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from adlm_model.inference.likelihood import MASK_DRAWS, ContinuationScorer
from adlm_model.testbed.language import BOS_ID, MASK_ID, Testbed, TestbedConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import add_argument, recording


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--requests", type=int, default=4, help="continuations (rows of the testbed)")
    p.add_argument("--length", type=int, default=32)
    p.add_argument("--context", type=int, default=12)
    p.add_argument("--continuation", type=int, default=12)
    add_argument(p)
    a = p.parse_args()
    with recording("lm_eval_mc_variance", a.record):
        measure(a)


def measure(a: argparse.Namespace) -> None:
    tb = Testbed(TestbedConfig(length=a.length))

    def oracle(z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        logp = tb.conditionals(z, MASK_ID)
        return -logp.gather(-1, x.clamp(max=logp.shape[-1] - 1)[..., None]).squeeze(-1)

    rows = tb.sample(a.requests, seed=11)
    c0, c1 = 1 + a.context, 1 + a.context + a.continuation
    pairs, exact = [], []
    for row in rows:
        pairs.append((row[1:c0].tolist(), row[c0:c1].tolist()))
        zj = torch.full((1, a.length), MASK_ID)
        zj[0, :c1] = row[:c1]
        zc = zj.clone()
        zc[0, c0:] = MASK_ID
        exact.append(float(tb.log_marginal(zj, MASK_ID) - tb.log_marginal(zc, MASK_ID)))
    var = {}
    for scheme in MASK_DRAWS:
        sc = ContinuationScorer(seq_len=a.length, mask_id=MASK_ID, bos_id=BOS_ID, nll_fn=oracle, samples=a.samples,
                                scheme=scheme, batch_size=512, greedy_max_tokens=0)
        spread, reported, bias = [], [], []
        for i, pair in enumerate(pairs):
            ests = [sc.score([pair], seeds=[1000 * r + i])[0][0] for r in range(a.repeats)]
            values = [e.loglik for e in ests]
            spread.append(statistics.stdev(values))
            reported.append(statistics.mean(e.stderr for e in ests))
            bias.append(statistics.mean(values) - exact[i])
        var[scheme] = statistics.mean(s * s for s in spread)
        print(f"{scheme:>10}: true stderr {statistics.mean(spread):.4f}, reported {statistics.mean(reported):.4f}, "
              f"bias {statistics.mean(bias):+.4f} (nats; {a.samples} draws, {a.repeats} repeats, {a.requests} requests "
              f"of {a.continuation} tokens)")
    for scheme in ("antithetic", "stratified"):
        print(f"RESULT variance_ratio_plain_over_{scheme}={var['plain'] / var[scheme]:.3f}")


if __name__ == "__main__":
    main()
