"""The export folder as a ``transformers`` model: ``AutoModelForMaskedLM.from_pretrained(folder,
trust_remote_code=True)`` loads every model kind offline from the same ``model.safetensors`` that
``adlm_model.load_pretrained`` reads, with no key missing or unexpected, and gives our logits exactly.

Fast and in-process: micro models with random weights (``tests/support/models.py``), no registry (the
registered-version path of ``python -m pipelines.export`` is tested in ``test_serving``).
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest
import torch

from adlm_model.baselines.bd3lm import block_causal_mask, block_diffusion_logits
from adlm_model.config import ModelConfig
from adlm_model.interop.pretrained import HF_CODE, HF_SOURCES, load_pretrained, save_pretrained, shipped_code
from adlm_model.kinds import KINDS
from tests.support.models import micro, randomized

SPECIALS = {"bos_id": 1, "eos_id": 2, "pad_id": 3, "mask_id": 48}


@pytest.fixture(autouse=True)
def _module_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers copies remote code into HF_MODULES_CACHE, fixed when it is first imported (perhaps before
    conftest moved HF_HOME): point it into the session's temp folder."""
    import transformers.dynamic_module_utils as dyn

    monkeypatch.setattr(dyn, "HF_MODULES_CACHE", str(tmp_path_factory.getbasetemp() / "hf_modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def _export(tmp_path: Path, kind: str, **kw) -> tuple[Path, torch.nn.Module]:
    cfg = micro(kind, **kw)
    model = randomized(cfg, seed=len(kind))
    tok = tmp_path / "tokenizer-source.json"
    tok.write_text("{}")
    d = save_pretrained(tmp_path / f"{kind}-export", model, cfg, tokenizer_json=tok, special_tokens=SPECIALS)
    return d, model


def _hf(d: Path) -> torch.nn.Module:
    from transformers import AutoModelForMaskedLM

    model, info = AutoModelForMaskedLM.from_pretrained(d, trust_remote_code=True, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and not info["mismatched_keys"]
    return model


@pytest.mark.parametrize("kind", [k for k, v in KINDS.items() if not v.sample_only])
def test_transformers_loads_every_kind_with_our_logits(tmp_path, kind, one_torch_thread) -> None:
    from transformers import AutoConfig

    d, model = _export(tmp_path, kind)
    ours, cfg, _ = load_pretrained(d)
    # load_pretrained stays bit for bit with the exported network
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ours.state_dict().values(),
                                                    strict=True))
    hf = _hf(d)
    assert not hf.training and hf.config.model == cfg.to_dict()
    assert type(AutoConfig.from_pretrained(d, trust_remote_code=True)).__name__ == "AdlmConfig"
    # the same parameter names and tensors as the file load_pretrained reads
    theirs = hf.state_dict()
    assert theirs.keys() == ours.state_dict().keys()
    assert all(torch.equal(theirs[k], v) for k, v in ours.state_dict().items())

    g = torch.Generator().manual_seed(0)
    z = torch.randint(0, cfg.width, (2, cfg.seq_len), generator=g)
    zeros = torch.zeros(2)
    with torch.no_grad():
        if kind == "bd3lm":  # x_t ++ x_0, as the reference Hub model takes it
            x0 = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
            want = block_diffusion_logits(ours, z, x0, zeros, cfg.block_size)
            got = hf(torch.cat([z, x0], dim=1)).logits
            mask = block_causal_mask(cfg.seq_len, cfg.block_size)
            assert torch.equal(hf(x0, sample_mode=True).logits, ours.backbone(x0, zeros, mask=mask))
        elif not KINDS[kind].diffusion:  # AR, A2R: next-token logits
            want, got = ours(z), hf(input_ids=z).logits
        elif cfg.conditions_on_time:  # SEDD: the raw score-network output at the sigma given
            sigma = torch.tensor([0.3, 1.2])
            want, got = ours.denoiser_logits(z, sigma), hf(input_ids=z, timesteps=sigma).logits
        else:
            want, got = ours.denoiser_logits(z, zeros), hf(input_ids=z).logits
    assert got.shape == (2, cfg.seq_len, cfg.width) and torch.equal(got, want)


def test_timesteps_feed_sigma_only_when_time_conditioned(tmp_path, one_torch_thread) -> None:
    d, _ = _export(tmp_path, "mdlm", time_conditioning=True)
    ours, cfg, _ = load_pretrained(d)
    hf = _hf(d)
    z = torch.randint(0, cfg.width, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.5, 2.0])
    with torch.no_grad():
        got = hf(z, timesteps=sigma).logits
        assert torch.equal(got, ours.denoiser_logits(z, sigma))
        assert not torch.equal(got, hf(z, timesteps=torch.zeros(2)).logits)
        with pytest.raises(ValueError, match="pass timesteps="):
            hf(z)
    # time conditioning off: sigma is 0 whatever is passed
    d, _ = _export(tmp_path, "adlm")
    hf = _hf(d)
    with torch.no_grad():
        assert torch.equal(hf(z, timesteps=sigma).logits, hf(z).logits)


def test_bad_inputs_are_refused_in_one_line(tmp_path, one_torch_thread) -> None:
    hf = _hf(_export(tmp_path, "bd3lm")[0])
    with pytest.raises(ValueError, match=r"x_t \+\+ x_0 \(an even length\)"):
        hf(torch.zeros(1, 7, dtype=torch.long))
    x = torch.zeros(1, 8, dtype=torch.long)
    assert hf(x, attention_mask=torch.ones_like(x)).logits.shape == (1, 4, 49)  # a mask hiding nothing; width 48 + 1
    with pytest.raises(ValueError, match="attention_mask hides positions"):
        hf(x, attention_mask=torch.tensor([[1] * 6 + [0] * 2]))


def test_the_shipped_code_is_the_packages_and_imports_only_torch() -> None:
    """The export ships this package's network modules, not a second copy: each file is its module with the
    relative imports flattened (the folder is flat), imports torch, the standard library and its shipped neighbours
    (the two wrappers also transformers); the wrappers' networks are the kinds table's."""
    import adlm_model
    from adlm_model.interop.modeling_adlm import NETWORKS

    pkg = Path(adlm_model.__file__).parent
    assert set(HF_CODE) == {Path(s).name for s in HF_SOURCES.values()}  # the folder's names are the modules' names
    for name in HF_CODE:
        allowed = {"torch", "__future__", *sys.stdlib_module_names}
        if name in ("configuration_adlm.py", "modeling_adlm.py"):
            allowed.add("transformers")
        source, shipped = (pkg / HF_SOURCES[name]).read_text(), shipped_code(name)
        # the same code but for the import lines: nothing else of the module is rewritten
        changed = [(a, b) for a, b in zip(source.splitlines(), shipped.splitlines(), strict=True) if a != b]
        assert all(a.lstrip().startswith("from .") and b.lstrip().startswith("from .") for a, b in changed), changed
        tree = ast.parse(shipped)
        # an import inside try/except is optional (attention.py's flash-attn): transformers' check skips it too
        optional = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for b in t.body for n in ast.walk(b)}
        for node in ast.walk(tree):
            if id(node) in optional:
                continue
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and f"{node.module}.py" in HF_CODE, \
                    f"{name} imports {'.' * node.level}{node.module}, which is not a shipped neighbour"
            elif isinstance(node, ast.Import | ast.ImportFrom):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                bad = [m for m in mods if m.split(".")[0] not in allowed]
                assert not bad, f"{name} imports {bad}: an export could not load it with torch alone"
    exported = {k: kind for k, kind in KINDS.items() if not kind.sample_only}  # SSD-LM: its Hub folder is its export
    assert set(NETWORKS) == set(exported)
    for k, kind in exported.items():  # the same parameters (names and shapes) as the kinds table's network
        cfg = ModelConfig(kind=k, vocab_size=16, mask_id=16, seq_len=8, hidden=16, heads=2, n_blocks=1,
                          denoiser_blocks=1, cond_dim=8, block_size=4)
        with torch.device("meta"):
            ours, shipped = kind.network(cfg).state_dict(), NETWORKS[k](cfg).state_dict()
        assert {n: t.shape for n, t in ours.items()} == {n: t.shape for n, t in shipped.items()}, k


def test_device_map_and_bfloat16_loads(tmp_path, one_torch_thread) -> None:
    """The loading paths GPU users take: ``device_map`` (the weights placed by transformers: same logits) and
    ``dtype=torch.bfloat16`` (weights cast; logits within bf16 rounding of the float32 ones)."""
    from transformers import AutoModelForMaskedLM

    d, _ = _export(tmp_path, "adlm")
    ours, cfg, _ = load_pretrained(d)
    z = torch.randint(0, cfg.width, (2, cfg.seq_len), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ours.denoiser_logits(z, torch.zeros(2))
        placed = AutoModelForMaskedLM.from_pretrained(d, trust_remote_code=True, device_map="cpu")
        assert torch.equal(placed(z).logits, want)
        half = AutoModelForMaskedLM.from_pretrained(d, trust_remote_code=True, dtype=torch.bfloat16)
        got = half(z).logits
    assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), want, atol=0.1 * want.abs().max().item())


OLD_EXPORT = Path(__file__).parents[1] / "fixtures" / "export-v0"
"""An ADLM export written by ``save_pretrained`` before ``adlm_model`` was cut into subpackages (commit 988c98b:
the package's flat modules copied as they were), with a 320-entry BPE trained on the embedded corpus;
``export-v0.expected.safetensors`` holds a batch ``z`` and the logits that code gave for it."""


def test_an_export_written_by_an_earlier_version_still_loads(one_torch_thread) -> None:
    """Both readers of an export (``load_pretrained`` and ``transformers`` with the folder's own code) load the old
    folder with no key missing, agree with each other bit for bit, and give the logits it was written with to
    float32 rounding: another CPU's matrix kernels round differently (seen: 2e-6 of logits up to 7.7 on an
    AVX-512 machine against the AVX2 one that wrote the fixture)."""
    from safetensors.torch import load_file

    expected = load_file(str(OLD_EXPORT.parent / "export-v0.expected.safetensors"))
    ours, cfg, meta = load_pretrained(OLD_EXPORT)
    assert cfg.kind == "adlm" and "fixture" in meta
    hf = _hf(OLD_EXPORT)
    z = expected["z"]
    with torch.no_grad():
        want = ours.denoiser_logits(z, torch.zeros(len(z)))
        got = hf(input_ids=z).logits
    assert torch.equal(got, want)
    assert torch.allclose(want, expected["logits"], rtol=1e-5, atol=1e-5), (want - expected["logits"]).abs().max()
