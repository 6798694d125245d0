"""Released checkpoints: each reference fixture (tests/fixtures/reference, made by the reference code:
see its source.json) imports onto our network and gives the reference's logits and NELBO at the same t and mask;
pickles are read without running them; the ADLM layout maps completely or is refused with its unmatched keys;
the importer's bad inputs are one line, before any registry write. In-process and CPU-cheap (no registry here:
tests/pipelines/test_import_pipeline.py registers a version and runs it through the pipeline)."""

from __future__ import annotations

import json
import os
import pickle
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from adlm_model.baselines.bd3lm import block_diffusion_logits, block_nelbo
from adlm_model.config import ModelConfig
from adlm_model.interop import reference_layouts as rl
from adlm_model.interop.safe_pickle import UnsafePickleError, load_pickled, resolve_global
from adlm_model.kinds import KINDS, build_model
from adlm_model.objectives.losses import mdlm_objective, suppress_mask

FIXTURES = Path(__file__).parents[1] / "fixtures" / "reference"
TOL = dict(rtol=1e-5, atol=1e-5)


def _import(path: Path) -> tuple[torch.nn.Module, ModelConfig, rl.Family]:
    src = rl.read_source(path)
    fam = rl.detect_family(src)
    width = rl.embedding_width(src, fam)
    model, cfg = rl.convert(src, fam, width - 1, width - 1)  # the fixtures' tokenizers append the mask
    return model, cfg, fam


def test_mdlm_lightning_checkpoint_equals_reference(one_torch_thread) -> None:
    """MDLM's .ckpt (its Diffusion module after 3 steps, EMA != weights): the EMA weights are the ones loaded, and
    logits and the NELBO at the reference's t and mask equal what the reference computed."""
    model, cfg, fam = _import(FIXTURES / "mdlm" / "mdlm.ckpt")
    exp = load_file(str(FIXTURES / "mdlm" / "expected.safetensors"))
    assert (fam.name, cfg.kind, cfg.seq_len, cfg.width, cfg.time_conditioning) == ("mdlm", "mdlm", 32, 513, False)
    with torch.no_grad():
        logits = model.denoiser_logits(exp["z_t"], torch.zeros(2))
        out = mdlm_objective(model, exp["x0"], None, cfg, t=exp["t"], z_t=exp["z_t"])
    torch.testing.assert_close(logits, exp["logits"], **TOL)
    assert float(out.nll_sum) == pytest.approx(float(exp["nll_sum"]), rel=1e-5)
    assert int(out.n_tokens) == int(exp["n_tokens"])
    # the raw (non-EMA) weights would not give the reference's figures: the EMA is what was loaded
    src = rl.read_source(FIXTURES / "mdlm" / "mdlm.ckpt")
    raw = rl.Source(src.tensors, src.hparams, src.layout, src.files)
    raw_model, _ = rl.convert(raw, fam, 512, 512)
    with torch.no_grad():
        assert not torch.allclose(raw_model.denoiser_logits(exp["z_t"], torch.zeros(2)), exp["logits"], **TOL)


def test_mdlm_hub_layout_equals_reference(tmp_path: Path, one_torch_thread) -> None:
    """The Hub layout of kuleshov-group/mdlm-owt (config.json with model_type mdlm, the MDLM PreTrainedModel's keys:
    its DiT under backbone., as the Lightning module's) written from the fixture's EMA weights imports to the same
    logits."""
    src = rl.read_source(FIXTURES / "mdlm" / "mdlm.ckpt")
    state = rl.weights(src, rl.FAMILIES["mdlm"])
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mdlm", "architectures": ["MDLM"], "vocab_size": 513, "model_length": 32, "hidden_dim": 16,
        "cond_dim": 8, "n_blocks": 1, "n_heads": 2, "dropout": 0.1, "time_conditioning": False}))
    model, cfg, fam = _import(tmp_path)
    exp = load_file(str(FIXTURES / "mdlm" / "expected.safetensors"))
    assert fam.name == "mdlm" and cfg.kind == "mdlm"
    with torch.no_grad():
        torch.testing.assert_close(model.denoiser_logits(exp["z_t"], torch.zeros(2)), exp["logits"], **TOL)


def test_ar_lightning_checkpoint_equals_reference(one_torch_thread) -> None:
    model, cfg, fam = _import(FIXTURES / "ar" / "ar.ckpt")
    exp = load_file(str(FIXTURES / "ar" / "expected.safetensors"))
    assert (fam.name, cfg.kind, cfg.uses_adaln) == ("ar", "ar", False)
    x0 = exp["x0"]
    with torch.no_grad():
        logp = torch.log_softmax(suppress_mask(model(x0), cfg.mask_id), -1)
        out = KINDS["ar"].eval_objective(model, x0, None, cfg)
    m = cfg.mask_id  # the reference puts the mask at -1000 before its log-softmax, ours at -inf
    torch.testing.assert_close(logp[..., :m], exp["log_probs"][..., :m], **TOL)
    assert float(out.nll_sum) == pytest.approx(float(exp["nll_sum"]), rel=1e-5)
    assert int(out.n_tokens) == int(exp["n_tokens"])


def _assert_bd3lm_equals_reference(model: torch.nn.Module, cfg: ModelConfig, exp: dict[str, torch.Tensor]) -> None:
    """The x_t-half logits of one pass over [x_t ; x_0] and the block NELBO at the reference's t and mask equal the
    figures the reference computed."""
    x0, z_t = exp["x0"], exp["z_t"]
    with torch.no_grad():
        logits = block_diffusion_logits(model, z_t, x0, torch.zeros(2), cfg.block_size)
        per_token, valid = block_nelbo(model, x0, None, cfg, t=exp["t"], z_t=z_t, train=False)
    torch.testing.assert_close(logits, exp["logits"], **TOL)
    assert float(per_token.sum()) == pytest.approx(float(exp["nll_sum"]), rel=1e-5)
    assert int(valid.sum()) == int(exp["n_tokens"])


@pytest.mark.parametrize("block", [4, 16])
def test_bd3lm_hub_layout_equals_reference(block: int, one_torch_thread) -> None:
    """BD3-LM's models/hf layout (written by its own BD3LM class + save_pretrained): the x_t-half logits of one pass
    over [x_t ; x_0] and the block NELBO at the reference's per-block t and mask (BOS left out) equal its figures."""
    model, cfg, fam = _import(FIXTURES / f"bd3lm-block{block}")
    exp = load_file(str(FIXTURES / f"bd3lm-block{block}" / "expected.safetensors"))
    assert (fam.name, cfg.kind, cfg.block_size, cfg.skips_bos) == ("bd3lm", "bd3lm", block, True)
    _assert_bd3lm_equals_reference(model, cfg, exp)


def test_bd3lm_lightning_checkpoint_equals_reference(one_torch_thread) -> None:
    """BD3-LM's own Lightning .ckpt (3 steps, EMA != weights; its clipping buffers in the state dict)."""
    model, cfg, fam = _import(FIXTURES / "bd3lm-lightning" / "bd3lm.ckpt")
    exp = load_file(str(FIXTURES / "bd3lm-lightning" / "expected.safetensors"))
    assert (fam.name, cfg.kind, cfg.block_size, cfg.clip_low, cfg.clip_high) == ("bd3lm", "bd3lm", 4, 0.0, 1.0)
    _assert_bd3lm_equals_reference(model, cfg, exp)


# ------------------------------------------------------------------------------------------------
# Pickle safety


class _Planted:
    """A pickle payload that would run a shell command when loaded (via __reduce__)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class SetsState:
    """A class whose __setstate__ would write a file: the loader must not import or call it."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __setstate__(self, state: dict) -> None:
        Path(state["marker"]).write_text("ran")


def test_planted_pickle_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    bad = tmp_path / "evil.ckpt"
    torch.save({"state_dict": OrderedDict(w=torch.zeros(2)), "hyper_parameters": {"x": _Planted(marker)}}, bad)
    with pytest.raises(UnsafePickleError) as e:
        load_pickled(bad)
    msg = str(e.value)
    assert "\n" not in msg and ("posix.system" in msg or "os.system" in msg)
    assert not marker.exists()
    # the importer refuses it in one `error:` line, exit 2, and nothing ran
    from pipelines.import_model import main

    assert main([str(bad), "--inspect"]) == 2
    assert not marker.exists()
    # a class of an unknown module becomes inert data: its __setstate__ never runs
    other = tmp_path / "state.ckpt"
    torch.save({"state_dict": OrderedDict(w=torch.ones(1)), "hyper_parameters": {"x": SetsState(marker)}}, other)
    obj = load_pickled(other)
    assert not marker.exists() and repr(obj["hyper_parameters"]["x"]).endswith("SetsState>")
    for module, name in (("builtins", "eval"), ("builtins", "exec"), ("subprocess", "Popen"), ("os", "system"),
                         ("functools", "partial"), ("torch", "load")):
        with pytest.raises(UnsafePickleError):
            resolve_global(module, name)


def test_bare_pickle_with_exec_is_refused(tmp_path: Path) -> None:
    """A legacy (non-zip) pickle reaching builtins.exec is refused too."""
    marker = tmp_path / "ran"

    class Exec:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').write('x')",))

    f = tmp_path / "legacy.bin"
    f.write_bytes(pickle.dumps({"w": Exec()}, protocol=2))
    with pytest.raises(UnsafePickleError):
        load_pickled(f)
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------
# ADLM: the assumed layout (ReMDM's Lightning module with the anchor under backbone., the denoiser under denoiser.)


def _reference_key(ours: str) -> str:
    """Our ADLM key -> the assumed reference key."""
    net, rest = ours.split(".", 1)
    rest = rest.replace("vocab_embed.weight", "vocab_embed.embedding")
    return ("backbone." if net == "anchor" else "denoiser.") + rest


def _adlm_checkpoint(path: Path, drop: str | None = None, wrap: str = "") -> tuple[torch.nn.Module, ModelConfig]:
    """A Lightning-style ADLM checkpoint in the assumed layout: state_dict with the reference names (rotary
    buffers included), EMA shadow parameters (different from the raw weights), hyper-parameters with the flags the
    ADLM README shows."""
    torch.manual_seed(0)
    cfg = ModelConfig(kind="adlm", vocab_size=64, mask_id=64, seq_len=16, hidden=16, heads=2, n_blocks=2,
                      denoiser_blocks=1, cond_dim=8)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    state: OrderedDict[str, torch.Tensor] = OrderedDict()
    for net in ("anchor", "denoiser"):
        for k, v in model.state_dict().items():
            if k.startswith(net + "."):
                state[_reference_key(k)] = v.clone()
                if k.endswith("vocab_embed.weight") or k.endswith("dense_in.bias"):
                    d = cfg.head_dim
                    state[f"{'backbone' if net == 'anchor' else 'denoiser'}.rotary_emb.inv_freq"] = \
                        1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ema = [v for k, v in state.items() if not k.endswith("inv_freq")]
    raw = OrderedDict((wrap + k, v if k.endswith("inv_freq") else v + 1.0) for k, v in state.items())
    if drop:
        raw.pop(drop)
        ema = ema[:-1]  # keep the EMA lined up with the remaining parameters (a consistently incomplete file)
    hp = {"config": {"model": {"hidden_size": 16, "n_heads": 2, "n_blocks": 2, "cond_dim": 8, "length": 16,
                               "dropout": 0.1}, "time_conditioning": False, "parameterization": "subs",
                     "algo": {"enable_anchor_loss": True, "base_scaling_factor1": 0.003, "threshold": 5}}}
    torch.save({"state_dict": raw, "ema": {"decay": 0.9999, "num_updates": 1, "shadow_params": ema},
                "hyper_parameters": hp, "epoch": 0, "global_step": 1}, path)
    return model.eval(), cfg


@pytest.mark.parametrize("wrap", ["", "module."])
def test_adlm_assumed_layout_imports(wrap: str, tmp_path: Path, one_torch_thread) -> None:
    """The assumed layout imports to the same denoiser logits (EMA weights, not the raw ones), also with DDP's
    ``module.`` wrapper around the keys."""
    ref, cfg = _adlm_checkpoint(tmp_path / "adlm.ckpt", wrap=wrap)
    model, got, fam = _import(tmp_path / "adlm.ckpt")
    assert fam.name == "adlm" and (got.n_blocks, got.denoiser_blocks, got.gamma, got.tau) == (2, 1, 0.003, 5)
    z = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model.denoiser_logits(z, torch.zeros(2)), ref.denoiser_logits(z, torch.zeros(2)))


def test_adlm_incomplete_layout_is_refused_listing_keys(tmp_path: Path) -> None:
    _adlm_checkpoint(tmp_path / "part.ckpt", drop="denoiser.output_layer.adaLN_modulation.bias")
    src = rl.read_source(tmp_path / "part.ckpt")
    with pytest.raises(rl.ImportRefused) as e:
        rl.convert(src, rl.detect_family(src), 64, 64)
    msg = str(e.value)
    assert "\n" not in msg and "denoiser.output_layer.adaLN_modulation.bias" in msg
    # a key of no known place is listed as unmatched
    src.tensors["backbone.extra_head.weight"] = torch.zeros(2)
    src.ema = None
    with pytest.raises(rl.ImportRefused, match=r"unmatched key\(s\): backbone.extra_head.weight"):
        rl.convert(src, rl.FAMILIES["adlm"], 64, 64)


# ------------------------------------------------------------------------------------------------
# The command's refusals: one line, exit 2, nothing registered


def word_tokenizer(path: Path, size: int = 64) -> Path:
    """A word-level tokenizer.json of ``size`` entries (EOS first, no mask: the mask is appended at ``size``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def test_import_command_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pipelines.import_model import main

    wd = tmp_path / "wd"
    tok64 = str(word_tokenizer(tmp_path / "tok" / "tokenizer.json"))
    cases = [
        (["kuleshov-group/mdlm-owt", "--revision", "main"], "cannot download kuleshov-group/mdlm-owt@main"),
        ([str(tmp_path / "nothing.ckpt")], "no such file or folder"),
        ([str(FIXTURES / "ar" / "ar.ckpt")], "names no released tokenizer"),
        ([str(FIXTURES / "ar" / "ar.ckpt"), "--tokenizer", "gpt2"], "does not fit the checkpoint's embedding"),
        ([str(FIXTURES / "ar" / "ar.ckpt"), "--family", "mdlm", "--tokenizer", tok64], "does not map completely"),
    ]
    for argv, needle in cases:
        assert main([*argv, "--workdir", str(wd)]) == 2, argv
        # Lines Ray's processes print into this test process's stderr (the session's Ray, "(pid=...)") are not the
        # command's.
        err = [ln for ln in capsys.readouterr().err.strip().splitlines() if "(pid=" not in ln[:40]]
        assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], (argv, err)
    assert not (wd / "mlflow.db").exists() and not (wd / "mlartifacts").exists()


def test_inspect_prints_tree_and_hyper_parameters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pipelines.import_model import main

    assert main([str(FIXTURES / "bd3lm-block16"), "--inspect", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "family: bd3lm" in out and "backbone.vocab_embed.embedding" in out and "(65, 16)" in out
    assert '"block_size": 16' in out
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("kind", ["mdlm", "bd3lm", "a2r"])
def test_exported_version_reimports_to_the_same_weights(kind: str, tmp_path: Path, one_torch_thread) -> None:
    """Our own Hub layout (python -m pipelines.export's folder, model_type adlm) is a source too: an exported
    MDLM-family or A2R checkpoint re-imports bit for bit, with its tokenizer."""
    from adlm_model.interop.checkpoint import save_checkpoint
    from pipelines.serving.export import export_model
    from pipelines.serving.importing import _tokenizer

    blocks = {"n_blocks": 2, "denoiser_blocks": 1} if kind == "a2r" else {"n_blocks": 1}  # A2R: anchor and AR model
    cfg = ModelConfig(kind=kind, vocab_size=64, mask_id=64, seq_len=16, hidden=16, heads=2, cond_dim=8, block_size=4,
                      **blocks)
    torch.manual_seed(3)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ckpt = save_checkpoint(tmp_path / "ckpt", model, cfg)
    word_tokenizer(ckpt / "tokenizer.json")
    export_model(str(ckpt), tmp_path / "export")
    src = rl.read_source(tmp_path / "export")
    fam = rl.detect_family(src)
    tok, read = _tokenizer(None, src, rl.embedding_width(src, fam), tmp_path / "export")
    assert read == [tmp_path / "export" / "tokenizer.json"]  # the tokenizer file read, for the import's sha256
    back, got = rl.convert(src, fam, tok.vocab_size, tok.mask_id)
    assert (src.layout, fam.name, got) == ("export", "adlm-export", cfg)
    want, have = model.state_dict(), back.state_dict()
    assert want.keys() == have.keys() and all(want[k].equal(have[k]) for k in want)


def test_object_store_sources_are_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A .ckpt file and a Hub-layout folder in an object store (a real S3 server on loopback) are downloaded and
    read like local ones (``--inspect``: nothing registered); a missing key is one line."""
    from pipelines.core.storage import upload_dir
    from pipelines.import_model import main
    from tests.support.cluster import s3_server

    with s3_server("imports") as srv:
        up = tmp_path / "up"
        up.mkdir()
        (up / "mdlm.ckpt").write_bytes((FIXTURES / "mdlm" / "mdlm.ckpt").read_bytes())
        upload_dir(up, f"s3://{srv.bucket}/ckpts")
        upload_dir(FIXTURES / "bd3lm-block4", f"s3://{srv.bucket}/bd3lm-block4")
        assert main([f"s3://{srv.bucket}/ckpts/mdlm.ckpt", "--inspect", "--workdir", str(tmp_path / "wd")]) == 0
        assert "family: mdlm" in capsys.readouterr().out
        assert main([f"s3://{srv.bucket}/bd3lm-block4", "--inspect", "--workdir", str(tmp_path / "wd")]) == 0
        assert "family: bd3lm" in capsys.readouterr().out
        assert main([f"s3://{srv.bucket}/nothing.ckpt", "--workdir", str(tmp_path / "wd")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and "nothing.ckpt" in err[0]


def test_sedd_hub_layout_equals_reference(tmp_path: Path, one_torch_thread) -> None:
    """SEDD's Hub layout (louaaron/sedd-*: the run config as config.json, the SEDD module's bare keys in
    model.safetensors), written from the SEDD fixture the reference made, imports as the sedd kind with the
    reference's log-scores and loss (tests/fixtures/reference/sedd/provenance.json)."""
    from adlm_model.baselines.sedd import sedd_objective
    from adlm_model.objectives.schedule import LogLinearSchedule

    ref_dir = FIXTURES / "sedd"
    prov = json.loads((ref_dir / "provenance.json").read_text())
    save_file(load_file(str(ref_dir / "weights.safetensors")), str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(prov["config"]))
    model, cfg, fam = _import(tmp_path)
    assert (fam.name, cfg.kind, cfg.conditions_on_time, cfg.width) == ("sedd", "sedd", True, 51)
    exp = load_file(str(ref_dir / "outputs.safetensors"))
    with torch.no_grad():
        log_score = model.log_score(exp["z_t"], LogLinearSchedule(cfg.noise_eps).sigma(exp["t"]))
        out = sedd_objective(model, exp["x"], None, cfg, t=exp["t"], z_t=exp["z_t"])
    torch.testing.assert_close(log_score, exp["log_score"], **TOL)
    torch.testing.assert_close(out.nll_sum.float(), exp["loss"].sum(), rtol=1e-5, atol=1e-4)
    # a uniform-graph SEDD is not the sedd kind: refused in one line
    (tmp_path / "config.json").write_text(json.dumps({**prov["config"], "graph": {"type": "uniform"}}))
    with pytest.raises(rl.ImportRefused, match="uniform"):
        _import(tmp_path)


def _sedd_reference_order(key: str) -> tuple:
    """Where ``key`` stands in the reference SEDD module's state_dict (``model/transformer.py``: the order its
    ``__init__`` registers parameters and buffers), which a training state's EMA list follows."""
    block = ["norm1.weight", "attn_qkv.weight", "attn_out.weight", "norm2.weight", "mlp.0.weight", "mlp.0.bias",
             "mlp.2.weight", "mlp.2.bias", "adaLN_modulation.weight", "adaLN_modulation.bias"]
    head = ["vocab_embed.embedding", "sigma_map.mlp.0.weight", "sigma_map.mlp.0.bias", "sigma_map.mlp.2.weight",
            "sigma_map.mlp.2.bias", "rotary_emb.inv_freq"]
    tail = ["output_layer.norm_final.weight", "output_layer.linear.weight", "output_layer.linear.bias",
            "output_layer.adaLN_modulation.weight", "output_layer.adaLN_modulation.bias"]
    if key in head:
        return (0, head.index(key))
    if key.startswith("blocks."):
        _, i, rest = key.split(".", 2)
        return (1, int(i), block.index(rest))
    return (2, tail.index(key))


def _assert_sedd_equals_reference(model: torch.nn.Module, cfg: ModelConfig) -> None:
    from adlm_model.objectives.schedule import LogLinearSchedule

    exp = load_file(str(FIXTURES / "sedd" / "outputs.safetensors"))
    with torch.no_grad():
        log_score = model.log_score(exp["z_t"], LogLinearSchedule(cfg.noise_eps).sigma(exp["t"]))
    torch.testing.assert_close(log_score, exp["log_score"], **TOL)


def test_sedd_local_run_and_hub_bin_import_to_the_reference(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             one_torch_thread) -> None:
    """SEDD's two other ways of holding the fixture's weights import to the reference's log-scores:

    - a local run as the reference's ``run_train.py`` leaves it: ``.hydra/config.yaml`` and
      ``checkpoints-meta/checkpoint.pth`` = ``utils.save_checkpoint``'s {optimizer, model, ema, step}, the EMA
      (here the fixture's weights) different from the raw weights and the one loaded, as ``load_model_local``
      does; by the run folder or by the file;
    - a Hub folder with ``pytorch_model.bin`` and no safetensors (what older ``PyTorchModelHubMixin`` wrote),
      read through the restricted unpickler.
    A training state whose run config is missing is refused in one line."""
    import yaml

    prov = json.loads((FIXTURES / "sedd" / "provenance.json").read_text())
    ref = load_file(str(FIXTURES / "sedd" / "weights.safetensors"))
    order = sorted(ref, key=_sedd_reference_order)
    run = tmp_path / "exp_local" / "openwebtext" / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump({**prov["config"], "training": {"ema": 0.9999}}))
    (run / "checkpoints-meta").mkdir()
    params = [k for k in order if not k.endswith("inv_freq")]
    opt = torch.optim.AdamW([torch.nn.Parameter(ref[k].clone()) for k in params])
    state = {"optimizer": opt.state_dict(), "model": OrderedDict((k, ref[k] + (0 if k.endswith("inv_freq") else 1))
                                                                 for k in order),
             "ema": {"decay": 0.9999, "num_updates": 3, "shadow_params": [ref[k].clone() for k in params]}, "step": 3}
    torch.save(state, run / "checkpoints-meta" / "checkpoint.pth")
    for source in (run, run / "checkpoints-meta" / "checkpoint.pth"):
        model, cfg, fam = _import(source)
        assert (fam.name, cfg.kind, cfg.width) == ("sedd", "sedd", 51)
        _assert_sedd_equals_reference(model, cfg)
    from pipelines.import_model import main

    assert main([str(run), "--inspect", "--workdir", str(tmp_path / "wd")]) == 0
    out = capsys.readouterr().out
    assert "layout: run" in out and "family: sedd" in out and f"ema: {len(params)} shadow parameters" in out
    # the training state alone, its run folder's config left behind: one line naming what to pass
    alone = tmp_path / "alone.pth"
    alone.write_bytes((run / "checkpoints-meta" / "checkpoint.pth").read_bytes())
    assert main([str(alone), "--workdir", str(tmp_path / "wd")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "without its run config: pass the run folder" in err[0], err
    # the Hub layout with pytorch_model.bin only
    hub = tmp_path / "hub"
    hub.mkdir()
    torch.save(OrderedDict((k, ref[k]) for k in order), hub / "pytorch_model.bin")
    (hub / "config.json").write_text(json.dumps(prov["config"]))
    model, cfg, fam = _import(hub)
    assert fam.name == "sedd" and rl.read_source(hub).files[-1].name == "pytorch_model.bin"
    _assert_sedd_equals_reference(model, cfg)
