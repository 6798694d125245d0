"""SSD-LM, sample-only: the released layout read exactly, and the sampler equal to the reference's.

The fixture (tests/fixtures/reference/ssdlm, its README says how it was made) is a tiny random SSD-LM written by
the reference's own code in the Hub layout, with the reference's logits at fixed inputs and one block of each of
the reference decoders (BD3-LM's ``generate_text.decode``: sampling projection; xhan77/ssd-lm's
``ssd_model_decode.decode``: multi-hot projection) with the noise they drew."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

FIXTURE = Path(__file__).parents[1] / "fixtures" / "reference" / "ssdlm"
HUB = FIXTURE / "hub"


@pytest.fixture(scope="module")
def ref() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE / "reference.safetensors"))


@pytest.fixture(scope="module")
def meta() -> dict:
    return json.loads((FIXTURE / "reference.json").read_text())


@pytest.fixture(scope="module")
def net():
    from adlm_model.interop import reference_layouts as rl
    from pipelines.data.tokenizer import bpe_from_files

    src = rl.read_source(HUB)
    fam = rl.detect_family(src)
    tok = bpe_from_files(HUB / "vocab.json", HUB / "merges.txt")
    model, cfg = rl.convert(src, fam, tok.vocab_size, tok.mask_id)
    return model, cfg, tok, fam


class Replay:
    """The reference's recorded draws: its Gaussians in order; its categorical choices, each checked to lie in the
    nucleus this code computed (what a draw from it could give)."""

    def __init__(self, gaussians: torch.Tensor, chosen: torch.Tensor | None = None) -> None:
        self.g, self.c = list(gaussians), list(chosen) if chosen is not None else []

    def gaussian(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        x = self.g.pop(0)
        assert tuple(x.shape) == shape
        return x.to(device)

    def categorical(self, probs: torch.Tensor) -> torch.Tensor:
        chosen = self.c.pop(0)
        assert bool((probs.gather(-1, chosen[..., None]) > 0).all()), "the reference drew outside this nucleus"
        return chosen


def test_the_released_layout_is_read_exactly_and_gives_the_references_logits(net, ref) -> None:
    model, cfg, tok, fam = net
    assert (fam.name, cfg.kind, cfg.hidden, cfg.n_blocks, cfg.heads, cfg.seq_len) == ("ssdlm", "ssdlm", 32, 2, 4, 64)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id, tok.mask_id) == (320, 0, 2, 1, 4)
    ctx, xt, t = ref["logits.context"], ref["logits.xt"], ref["logits.t"]
    with torch.no_grad():
        got = model.block_logits(ctx, torch.softmax(xt, dim=-1), t / int(ref["logits.total_t"]))
        plain = model(ctx)
    want = ref["logits.logits"][:, ctx.shape[1]:]
    assert got.shape == want.shape == (2, 5, 320)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(plain, ref["logits.plain_logits"], rtol=1e-5, atol=2e-5)
    # the timestep and the simplex projection matter: another t gives other logits
    with torch.no_grad():
        other = model.block_logits(ctx, torch.softmax(xt, dim=-1), t.flip(0) / 1000)
    assert (other - want).abs().max() > 1e-2


@pytest.mark.parametrize("projection", ["multihot", "sampling"])
def test_fed_the_references_noise_one_block_takes_its_every_step(net, ref, meta, projection: str) -> None:
    from adlm_model.baselines.ssdlm import decode_block

    model, *_ = net
    replay = Replay(ref[f"{projection}.noise"], ref["sampling.selected"] if projection == "sampling" else None)
    steps: list[torch.Tensor] = []
    top_p = meta["sampling_top_p"] if projection == "sampling" else meta["multihot_top_p"]
    with torch.no_grad():
        ids = decode_block(model, ref[f"{projection}.context"], batch=1, block=meta["block"], steps=meta["steps"],
                           top_p=top_p, one_hot=float(meta["one_hot"]), projection=projection, noise=replay,
                           on_step=lambda t, logits: steps.append(logits.argmax(-1)))
    assert not replay.g and not replay.c  # every recorded draw used, in the reference's order
    assert torch.equal(torch.stack(steps), ref[f"{projection}.argmax"])
    assert torch.equal(ids, ref[f"{projection}.tokens"])


@pytest.mark.parametrize("projection", ["sampling", "multihot"])
def test_the_references_seed_gives_its_tokens(net, ref, meta, projection: str) -> None:
    """On a CPU the generator draws what the reference drew from the global one after ``torch.manual_seed``."""
    from adlm_model import sample

    model, cfg, *_ = net
    ctx = ref[f"{projection}.context"]
    g = torch.Generator().manual_seed(int(ref[f"{projection}.seed"]))
    top_p = meta["sampling_top_p"] if projection == "sampling" else meta["multihot_top_p"]
    out = sample(model, cfg, batch_size=1, length=ctx.shape[1] + meta["block"], steps=meta["steps"], sampler="ssdlm",
                 nucleus_p=top_p, generator=g, prefix=ctx, block_size=meta["block"], one_hot=float(meta["one_hot"]),
                 projection=projection)
    assert torch.equal(out[:, :ctx.shape[1]], ctx)
    assert torch.equal(out[:, ctx.shape[1]:], ref[f"{projection}.tokens"])


def test_whole_blocks_are_drawn_and_each_block_sees_the_last_context_tokens(net, monkeypatch) -> None:
    """A length that is no multiple of B keeps the first tokens of whole blocks (the same draws as the longer
    request); each block sees the last ``context`` tokens before it, the first one BOS alone given no prompt."""
    import adlm_model.baselines.ssdlm as ssdlm
    from adlm_model import sample

    model, cfg, tok, _ = net

    def run(length: int, **kw) -> torch.Tensor:
        return sample(model, cfg, batch_size=2, length=length, steps=2, sampler="ssdlm", nucleus_p=0.95,
                      generator=torch.Generator().manual_seed(5), block_size=5, bos_id=tok.bos_id, **kw)

    short, whole = run(12), run(15)
    assert short.shape == (2, 12) and torch.equal(short, whole[:, :12])
    seen: list[torch.Tensor] = []
    real = ssdlm.decode_block
    monkeypatch.setattr(ssdlm, "decode_block", lambda m, ctx, **kw: seen.append(ctx.clone()) or real(m, ctx, **kw))
    out = run(15, context=5)
    assert [c.shape[1] for c in seen] == [1, 5, 5] and bool((seen[0] == tok.bos_id).all())
    assert torch.equal(seen[1], out[:, :5]) and torch.equal(seen[2], out[:, 5:10])
    seen.clear()
    run(15)  # context 0: as many as fit (64 - 5 = 59): every token before the block
    assert [c.shape[1] for c in seen] == [1, 6, 11]


def test_bad_settings_and_other_kinds_are_refused_in_one_line(net) -> None:
    from adlm_model import ModelConfig, build_model, sample
    from adlm_model.inference.infill import plan_infill
    from adlm_model.sampling.samplers import SamplerError

    model, cfg, tok, _ = net
    g = torch.Generator().manual_seed(0)
    cases = [
        (dict(sampler="ssdlm", projection="soft"), "projection must be one of sampling, multihot"),
        (dict(sampler="ssdlm", block_size=64), "leaves no room for context"),
        (dict(sampler="ssdlm", block_size=5, context=60), r"context must lie in \[0, 59\]"),
        (dict(sampler="ssdlm"), "needs a first token"),
        (dict(sampler="mdlm"), "sampler 'mdlm' does not run on a ssdlm model; it takes ssdlm"),
        (dict(sampler="ar", bos_id=0), "sampler 'ar' does not run on a ssdlm model"),
    ]
    for kw, msg in cases:
        with pytest.raises(SamplerError, match=msg) as e:
            sample(model, cfg, batch_size=1, length=8, steps=2, nucleus_p=0.9, generator=g, **kw)
        assert "\n" not in str(e.value)
    with pytest.raises(SamplerError, match="cannot infill"):
        sample(model, cfg, batch_size=1, length=8, steps=2, nucleus_p=0.9, generator=g, sampler="ssdlm",
               prefix=(torch.tensor([[0, 5, 6, 4, 4, 4, 4, 9]]), torch.tensor([[1, 1, 1, 0, 0, 0, 0, 1]]).bool()))
    with pytest.raises(SamplerError, match="generates left to right and cannot infill"):
        plan_infill(cfg, "ssdlm", 3, 8, 2, tok.bos_id)
    assert plan_infill(cfg, "ssdlm", 3, 200, 0, tok.bos_id).new == 200  # any length past the 64 positions
    small = ModelConfig(kind="mdlm", vocab_size=16, mask_id=16, seq_len=8, hidden=16, heads=2, n_blocks=1, cond_dim=8)
    with pytest.raises(SamplerError, match="sampler 'ssdlm' does not run on a mdlm model"):
        sample(build_model(small), small, batch_size=1, length=8, steps=2, nucleus_p=0.9, generator=g,
               sampler="ssdlm", bos_id=0)


class _Bigram:
    """A causal scorer whose logits at a position depend on its token only: any window gives the same NLL."""

    name, eos_id, max_length = "bigram", 0, 8

    def __init__(self) -> None:
        self.table = torch.randn(11, 11, generator=torch.Generator().manual_seed(0))

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [[int(c) for c in t] for t in texts]

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        assert input_ids.shape[1] <= self.max_length
        return self.table[input_ids]


def test_long_samples_are_scored_once_per_token_in_sliding_windows() -> None:
    from pipelines.evaluation.metrics import generative_perplexity, reached_length, sliding_window_nll

    lm = _Bigram()
    seqs = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5]]
    full = [torch.log_softmax(lm.table[torch.tensor(s[:-1])], -1).gather(-1, torch.tensor(s[1:])[:, None]) for s in seqs]
    want = -float(torch.cat(full).sum())
    for stride in (1, 3, 4, 7):
        total, count = sliding_window_nll(lm, seqs, 8, stride)
        assert count == sum(len(s) - 1 for s in seqs) and abs(total - want) < 1e-4, stride
    texts = ["".join(map(str, s)) for s in seqs]
    r = generative_perplexity(lm, texts, max_length=100, first_token="drop", stride=4)
    assert r.n_tokens == sum(len(s) - 1 for s in seqs) and abs(r.nll_sum - want) < 1e-4
    cut = generative_perplexity(lm, texts, max_length=100, first_token="drop")  # the default: truncated to 8
    assert cut.n_tokens == 2 * 7
    assert reached_length(list(range(40)), 10, 2.0) and not reached_length(list(range(30)) + [7] * 10, 10, 2.0)
    assert reached_length([1] * 9, 10, 2.0)  # no whole window: nothing to fail
