"""adlm_model.train.flops counts attention on CPU too: QK^T and AV of every block, forward and backward, so that
equal-FLOPs budgets weigh sequence length as the kernels do."""

from __future__ import annotations

import pytest

from adlm_model import preset
from adlm_model.train.flops import training_flops_per_row


def _cfg(kind: str, seq_len: int = 32):
    return preset("tiny", kind=kind, vocab_size=48, mask_id=48, seq_len=seq_len, hidden=32, heads=2, n_blocks=2,
                  denoiser_blocks=1, cond_dim=16, dropout=0.0, block_size=4)


@pytest.mark.parametrize("kind,blocks,length_factor", [("mdlm", 2, 1), ("adlm", 3, 1), ("ar", 2, 1), ("bd3lm", 2, 2)])
def test_attention_adds_qk_and_av_of_every_block(kind, blocks, length_factor):
    """Per row and block: forward QK^T + AV = 4 L^2 d, backward 10 L^2 d (torch's SDPA formulas); BD3-LM attends
    over x_t (+) x_0, twice the length."""
    cfg = _cfg(kind)
    L = cfg.seq_len * length_factor
    extra = training_flops_per_row(cfg) - training_flops_per_row(cfg, count_attention=False)
    assert extra == blocks * 14 * L * L * cfg.hidden


def test_attention_grows_quadratically_with_length():
    short, long = (training_flops_per_row(_cfg("mdlm", n)) - training_flops_per_row(_cfg("mdlm", n), count_attention=False)
                   for n in (16, 32))
    assert long == 4 * short > 0
