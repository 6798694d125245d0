"""Where the natural-preset models' samples excess comes from: the true NLL excess
over the exact entropy of the exact sampler's samples (``mdlm``, seed 7, BOS/EOS given) at several step counts and
nucleus settings, for a cached benchmark model or for the exact denoiser itself (``--model oracle``).

    python benchmarks/runs/2026-11-27_cpu_network_pilot/samples_excess.py --model oracle --steps 32,128
    python benchmarks/runs/2026-11-27_cpu_network_pilot/samples_excess.py --model W/mdlm-natural-L32-343e4b581d22 \\
        --steps 32,128,512
    python benchmarks/runs/2026-11-27_cpu_network_pilot/samples_excess.py --model W/mdlm-natural-L32-343e4b581d22 \\
        --rows 256 --nucleus 1.0,0.99,0.95,0.9,0.8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from adlm_model import ModelConfig, build_model, sample, unigram_entropy
from adlm_model.testbed import BOS_ID, EOS_ID, MASK_ID, OracleDenoiser, Testbed, TestbedConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a cached benchmark model's folder, or 'oracle'")
    p.add_argument("--steps", default="32", help="sampling steps, comma-separated (default 32 = L)")
    p.add_argument("--nucleus", default="1.0", help="nucleus p values, comma-separated (default 1.0: off)")
    p.add_argument("--rows", type=int, default=128)
    args = p.parse_args()
    torch.set_num_threads(1)
    tb = Testbed(TestbedConfig.natural(length=32))
    h, L = tb.entropy_per_token().mean, tb.length
    if args.model == "oracle":
        cfg = ModelConfig(kind="mdlm", vocab_size=tb.vocab_size, mask_id=MASK_ID, seq_len=L, hidden=8, heads=2)
        model = OracleDenoiser(tb)
    else:
        meta = json.loads((Path(args.model) / "meta.json").read_text())
        cfg = ModelConfig.from_dict(meta["recipe"]["model"])
        model = build_model(cfg)
        model.load_state_dict(load_file(str(Path(args.model) / "model.safetensors")))
        model.eval()
    tokens = torch.full((1, L), MASK_ID, dtype=torch.long)
    tokens[0, 0], tokens[0, -1] = BOS_ID, EOS_ID
    for steps in (int(s) for s in args.steps.split(",")):
        for nucleus in (float(q) for q in args.nucleus.split(",")):
            with torch.no_grad():
                out = sample(model, cfg, batch_size=args.rows, length=L, steps=steps, sampler="mdlm",
                             nucleus_p=nucleus, generator=torch.Generator().manual_seed(7),
                             prefix=(tokens, tokens != MASK_ID))
            lp = tb.log_prob(out)
            ok = torch.isfinite(lp)
            rows = -lp[ok] / L - h
            ent = statistics.fmean(unigram_entropy(r[1:-1]) for r in out)
            print(f"T={steps} nucleus {nucleus}: excess {float(rows.mean()):+.3f} (median row "
                  f"{float(rows.median()):+.3f}), impossible {float((~ok).float().mean()):.3f}, "
                  f"unigram entropy {ent:.3f}", flush=True)


if __name__ == "__main__":
    main()
