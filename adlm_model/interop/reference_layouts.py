"""The released checkpoints' layouts and how each maps onto this code's networks (docs: usage/released-models.md).

A *family* is one table entry (:data:`FAMILIES`): the model kind it becomes, the reference repository and commit
whose layout it follows, how to recognise it, how to read its hyper-parameters and one function mapping a
reference state-dict key to ours. Adding a family is one entry plus one mapping function (SEDD's: ``map_sedd``,
with ``sedd_layout`` reading its run config; SSD-LM's: ``map_ssdlm`` and ``config_ssdlm``).

Reading (:func:`read_source`, ``reference_sources``) takes a Lightning ``.ckpt``, a Hub-layout folder, a SEDD run
or this project's own export folder (with SSD-LM's ``embed_sum_layer`` / ``timestep_layer`` files beside a Hub
folder's weights), running none of their code, and refuses anything unreadable in one line. A
Lightning checkpoint's (and a SEDD run's) ``ema`` shadow parameters replace the raw weights (what the references
evaluate and release). :func:`convert` builds our network and loads every tensor, or refuses in one line listing
the keys that did not map: never a half-loaded model.

Conventions that differ between the references and this code (each checked by the fixture tests):

- embedding: the references keep a Parameter ``vocab_embed.embedding``; ours is ``nn.Embedding``
  (``vocab_embed.weight``), same (width, hidden) matrix;
- rotary: the references store ``rotary_emb.inv_freq`` (base 10000, rotate-half) as a buffer; ours computes the
  same frequencies (non-persistent): the stored one is checked equal and dropped;
- mask id: appended after the vocabulary (GPT-2: 50257, width 50258) or the tokenizer's own ``[MASK]``
  (BERT: 103); its logit is -inf here, -1e6 (MDLM, BD3-LM) or -1000 (AR) in the references;
- BD3-LM's learned clipped schedule (buffers ``sampling_eps_min/max``) becomes ``clip_low``/``clip_high``.

Longer than 500 lines because it is the one table: every family's entry, its mapping and its config function sit
beside the others, so that a new released layout is one place to read and one to add.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..config import ConfigError, ModelConfig
from ..kinds import build_model
from .checkpoint import oversized
from .reference_sources import PICKLE_SUFFIXES, ImportRefused, Source, normalise_key, read_source
from .sedd_layout import PREFIXES as SEDD_PREFIXES
from .sedd_layout import sedd_config

DROP = ""
"""What a mapping function returns for a reference key that is a derived constant, checked and not loaded."""

# --------------------------------------------------------------------------------------------------
# The mapping functions: reference key -> our key, DROP, or None (unmatched)

_DIT_PARTS = ("sigma_map.", "blocks.", "output_layer.")


def _dit_key(rest: str, ours: str) -> str | None:
    """A key inside one reference DiT (``rest``, after its prefix) -> ours under prefix ``ours``."""
    if rest == "vocab_embed.embedding":
        return f"{ours}vocab_embed.weight"
    if rest == "rotary_emb.inv_freq":
        return DROP
    if rest.startswith(_DIT_PARTS):
        return ours + rest
    return None


def map_backbone(key: str) -> str | None:
    """MDLM / AR / BD3-LM (Lightning and Hub): one DiT under ``backbone.``; BD3-LM's clipping buffers are read by
    its config function."""
    if key in ("sampling_eps_min", "sampling_eps_max"):
        return DROP
    return _dit_key(key[len("backbone."):], "backbone.") if key.startswith("backbone.") else None


def map_sedd(key: str) -> str | None:
    """SEDD's Hub layout (louaaron/sedd-*): its DiT's keys bare, without a prefix (``sedd_layout``)."""
    return _dit_key(re.sub(rf"^({'|'.join(map(re.escape, SEDD_PREFIXES))})+", "", key), "backbone.")


SSDLM_DERIVED = ("roberta.embeddings.position_ids", "roberta.embeddings.token_type_ids", "lm_head.decoder.weight",
                 "lm_head.decoder.bias")
"""RobertaForMaskedLM's buffers and its decoder tied to the word embeddings and ``lm_head.bias``: checked by
``config_ssdlm``, not loaded."""


def map_ssdlm(key: str) -> str | None:
    """SSD-LM's Hub layout (xhan77/ssdlm): ``transformers``' RobertaForMaskedLM keys, which ``ssdlm.SSDLM`` keeps,
    plus ``embed_sum_layer.`` and ``timestep_layer.`` (``HUB_MODULE_FILES``)."""
    if key in SSDLM_DERIVED:
        return DROP
    if key.startswith(("roberta.embeddings.", "roberta.encoder.layer.", "lm_head.", "embed_sum_layer.",
                       "timestep_layer.")):
        return key
    return None


def map_identity(key: str) -> str | None:
    """This project's own export: our keys already."""
    return key


# ADLM (assumed layout, docs/usage/released-models.md): ReMDM's Lightning module (the network under ``backbone.``)
# with the anchor network and the denoiser; the denoiser's token embedding replaced by a dense input layer.
ADLM_ANCHOR_PREFIXES = ("backbone.anchor.", "anchor.", "backbone.")
ADLM_DENOISER_PREFIXES = ("backbone.denoiser.", "denoiser.", "backbone2.")
ADLM_DENSE_INPUT_NAMES = ("dense_in", "vocab_embed", "input_proj", "in_proj")


def map_adlm(key: str) -> str | None:
    for pre in ADLM_DENOISER_PREFIXES:  # first: "backbone.denoiser." also starts with "backbone."
        if key.startswith(pre):
            rest = key[len(pre):]
            m = re.fullmatch(r"([A-Za-z_]+)\.(weight|bias)", rest)
            if m and m.group(1) in ADLM_DENSE_INPUT_NAMES:
                return f"denoiser.dense_in.{m.group(2)}"
            return _dit_key(rest, "denoiser.")
    for pre in ADLM_ANCHOR_PREFIXES:
        if key.startswith(pre):
            return _dit_key(key[len(pre):], "anchor.")
    return None


# --------------------------------------------------------------------------------------------------
# The config functions: Source (+ its weights) -> ModelConfig fields besides vocab_size / mask_id


def _blocks(tensors: dict[str, torch.Tensor], prefix: str) -> int:
    idx = {int(m.group(1)) for k in tensors if (m := re.match(re.escape(prefix) + r"blocks\.(\d+)\.", k))}
    return max(idx) + 1 if idx else 0


def _need(value: Any, what: str, src: Source) -> Any:
    if value is None:
        raise ImportRefused(f"the checkpoint's hyper-parameters do not give {what} ({src.layout} layout); "
                            "pass --family and check the file is a released checkpoint")
    return value


def _dit_fields(src: Source, prefix: str, embed_key: str) -> dict[str, Any]:
    t = src.tensors
    if embed_key not in t:
        raise ImportRefused(f"no {embed_key} in the checkpoint: not this family's layout")
    hidden = t[embed_key].shape[1]
    fields = dict(hidden=hidden, n_blocks=_blocks(t, prefix),
                  heads=int(_need(src.find("n_heads"), "the number of heads (n_heads)", src)),
                  seq_len=int(_need(src.find("length", "model_length"), "the sequence length (model.length)", src)),
                  dropout=float(src.find("dropout") or 0.0))
    mlp = t.get(f"{prefix}blocks.0.mlp.0.weight")
    if mlp is not None:
        fields["mlp_ratio"] = mlp.shape[0] // hidden
    sig = t.get(f"{prefix}sigma_map.mlp.0.weight")
    if sig is not None:
        fields["cond_dim"] = sig.shape[0]
    tc = src.find("time_conditioning")
    fields["time_conditioning"] = bool(tc) if tc is not None else False
    return fields


def config_mdlm(src: Source) -> dict[str, Any]:
    return dict(kind="mdlm", **_dit_fields(src, "backbone.", "backbone.vocab_embed.embedding"))


def config_ar(src: Source) -> dict[str, Any]:
    f = _dit_fields(src, "backbone.", "backbone.vocab_embed.embedding")
    f.pop("cond_dim", None)
    return dict(kind="ar", adaln=False, **f)


def config_bd3lm(src: Source) -> dict[str, Any]:
    f = dict(kind="bd3lm", **_dit_fields(src, "backbone.", "backbone.vocab_embed.embedding"))
    f["block_size"] = int(_need(src.find("block_size"), "the block size (block_size)", src))
    lo, hi = src.tensors.get("sampling_eps_min"), src.tensors.get("sampling_eps_max")
    # (1e-3, 1) stored in float32: the unclipped schedule, our defaults
    if lo is not None and hi is not None and (abs(float(lo) - 1e-3) > 1e-7 or abs(float(hi) - 1.0) > 1e-7):
        f.update(clip_low=round(float(lo), 6), clip_high=round(float(hi), 6))
    return f


def config_adlm(src: Source) -> dict[str, Any]:
    anchor = next((p for p in ADLM_ANCHOR_PREFIXES if f"{p}vocab_embed.embedding" in src.tensors), None)
    den = next((p for p in ADLM_DENOISER_PREFIXES if any(k.startswith(p) for k in src.tensors)), None)
    if anchor is None or den is None:
        raise ImportRefused("not an ADLM layout: it needs an anchor network (backbone.vocab_embed.embedding) and a "
                            f"denoiser (keys under one of {', '.join(ADLM_DENOISER_PREFIXES)})")
    f = dict(kind="adlm", **_dit_fields(src, anchor, f"{anchor}vocab_embed.embedding"))
    f["denoiser_blocks"] = _blocks(src.tensors, den)
    gamma, tau = src.find("base_scaling_factor1"), src.find("threshold")
    if gamma is not None:
        f["gamma"] = float(gamma)
    if tau is not None:
        f["tau"] = int(tau)
    return f


def config_sedd(src: Source) -> dict[str, Any]:
    """SEDD's run config (``config.json`` of the Hub model: graph, noise, model): only the absorbing graph with the
    log-linear noise and the scaled score is the ``sedd`` kind (``sedd_layout.sedd_config`` refuses the rest)."""
    try:
        d = sedd_config(src.hparams).to_dict()
    except ConfigError as e:
        raise ImportRefused(str(e)) from None
    return {k: v for k, v in d.items() if k not in ("vocab_size", "mask_id")}


def config_mdlm_sedd(src: Source) -> dict[str, Any]:
    """MDLM's SEDD baseline (.ckpt of its Diffusion module, ``parameterization: sedd``): MDLM's DiT, time-conditioned,
    read through the SEDD score (the same shift by log(e^sigma - 1) + log(V - 1) as the SEDD reference)."""
    f = _dit_fields(src, "backbone.", "backbone.vocab_embed.embedding")
    f["time_conditioning"] = True
    return dict(kind="sedd", **f)


def _sedd_hub(src: Source) -> bool:
    """SEDD's Hub layout, or a SEDD run's training state (layout ``run``) with its hydra config."""
    cfg = src.hparams.get("config") if isinstance(src.hparams.get("config"), dict) else src.hparams
    return src.layout in ("hub", "run") and isinstance(cfg.get("graph"), dict) and "vocab_embed.embedding" in {
        normalise_key(k).removeprefix("score_model.") for k in src.tensors}


SSDLM_FIXED = {"hidden_act": "gelu", "layer_norm_eps": 1e-5, "type_vocab_size": 1, "pad_token_id": 1,
               "position_embedding_type": "absolute"}
"""RoBERTa's settings that ``ssdlm.SSDLM`` builds in (``LAYER_NORM_EPS``, ``POSITION_OFFSET`` = pad id + 1, one
token type): a config.json with other values is refused."""


def config_ssdlm(src: Source) -> dict[str, Any]:
    """SSD-LM's config.json (RoBERTa's) -> our fields; the tied decoder and bias checked equal to what they tie."""
    hp, t = src.hparams, src.tensors
    for k, v in SSDLM_FIXED.items():
        if k in hp and hp[k] != v:
            raise ImportRefused(f"config.json has {k}={hp[k]!r}; the SSD-LM network here is RoBERTa with {k}={v!r}")
    hidden = int(_need(hp.get("hidden_size"), "hidden_size", src))
    inner = int(_need(hp.get("intermediate_size"), "intermediate_size", src))
    if inner % hidden:
        raise ImportRefused(f"intermediate_size {inner} is no multiple of hidden_size {hidden}")
    words = t.get("roberta.embeddings.word_embeddings.weight")
    if words is None:
        raise ImportRefused("no roberta.embeddings.word_embeddings.weight: not SSD-LM's RobertaForMaskedLM layout")
    dec, bias = t.get("lm_head.decoder.weight"), t.get("lm_head.bias")
    if dec is not None and not torch.equal(dec, words):
        raise ImportRefused("lm_head.decoder.weight differs from the word embeddings: the SSD-LM network here ties "
                            "them (tie_word_embeddings), as the released model does")
    dec_bias = t.get("lm_head.decoder.bias")
    if dec_bias is not None and (bias is None or not torch.equal(dec_bias, bias)):
        raise ImportRefused("lm_head.decoder.bias differs from lm_head.bias, which it ties to")
    return dict(kind="ssdlm", hidden=hidden, heads=int(_need(hp.get("num_attention_heads"), "num_attention_heads", src)),
                n_blocks=int(_need(hp.get("num_hidden_layers"), "num_hidden_layers", src)), mlp_ratio=inner // hidden,
                seq_len=int(_need(hp.get("max_position_embeddings"), "max_position_embeddings", src)) - 2,
                dropout=float(hp.get("hidden_dropout_prob", 0.1)))


def config_export(src: Source) -> dict[str, Any]:
    d = dict(src.hparams["model"])
    d.pop("vocab_size", None)
    d.pop("mask_id", None)
    return d


# --------------------------------------------------------------------------------------------------
# The table


def _has(*keys: str) -> Callable[[Source], bool]:
    return lambda s: all(k in s.tensors for k in keys)


def _parameterization(src: Source) -> str | None:
    return src.find("parameterization") if src.layout == "lightning" else None


def _adlm_like(src: Source) -> bool:
    return src.layout != "export" and (src.find("enable_anchor_loss") is not None
                                       or any(k.startswith(ADLM_DENOISER_PREFIXES) for k in src.tensors))


@dataclass(frozen=True)
class Family:
    """One released layout."""

    name: str
    kind: str
    """The ``ModelConfig.kind`` it becomes."""
    reference: str
    """Repository (and commit) whose layout it follows, and which the fixture's figures came from."""
    commit: str
    license: str
    matches: Callable[[Source], bool]
    config: Callable[[Source], dict[str, Any]]
    map_key: Callable[[str], str | None]
    buffers: tuple[str, ...] = ("rotary_emb.inv_freq", "sampling_eps_min", "sampling_eps_max")
    """Suffixes of the state-dict keys that are buffers, not parameters (the EMA holds parameters only)."""
    note: str = ""
    tokenizer_files: tuple[str, ...] = ()
    """The files of the tokenizer a released folder of this family carries beside the weights (RoBERTa's BPE for
    SSD-LM): the import builds the tokenizer from them, or from ``--tokenizer DIR`` holding them."""
    layout: str = ""
    """The only source layout it reads (``export``: this project's own folder); empty: any released one."""


MDLM_COMMIT = "c112c526d193436838c98d81455ee51f90309470"
BD3LMS_COMMIT = "1c3e8f43d88dfbcee5ff2aa6932a9e74b31ae1d7"
REMDM_COMMIT = "f830d659fb98d9b2c79ff71bfa12d578312b688a"
SEDD_COMMIT = "0605786da5ccb5747545e26d66fdf477187598b6"
SSDLM_COMMIT = "c0b67612c27928350aa073b303bc9df3a0e87f28"

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("mdlm", "mdlm", "kuleshov-group/mdlm", MDLM_COMMIT, "apache-2.0",
           lambda s: (s.layout == "lightning" and _parameterization(s) == "subs" and not _adlm_like(s)
                      and s.find("cross_attn") is not True
                      and _has("backbone.vocab_embed.embedding", "backbone.sigma_map.mlp.0.weight")(s))
           or (s.layout == "hub" and s.hparams.get("model_type") == "mdlm"),
           config_mdlm, map_backbone,
           note="Lightning .ckpt of its Diffusion module (EMA applied) or the Hub layout of kuleshov-group/mdlm-owt"),
    Family("ar", "ar", "kuleshov-group/mdlm", MDLM_COMMIT, "apache-2.0",
           lambda s: s.layout == "lightning" and _parameterization(s) == "ar"
           and _has("backbone.vocab_embed.embedding")(s) and "backbone.sigma_map.mlp.0.weight" not in s.tensors,
           config_ar, map_backbone, note="MDLM's AR baseline (.ckpt): causal, no adaLN"),
    Family("bd3lm", "bd3lm", "kuleshov-group/bd3lms", BD3LMS_COMMIT, "apache-2.0",
           lambda s: (s.layout == "hub" and s.hparams.get("model_type") == "bd3lm")
           or (s.layout == "lightning" and s.find("cross_attn") is True and s.find("block_size") is not None),
           config_bd3lm, map_backbone, note="its models/hf Hub layout (kuleshov-group/bd3lm-owt-block_size*)"),
    Family("sedd", "sedd", "louaaron/Score-Entropy-Discrete-Diffusion", SEDD_COMMIT, "mit", _sedd_hub,
           config_sedd, map_sedd, note="its Hub layout (louaaron/sedd-small, louaaron/sedd-medium: config.json + "
                                       "model.safetensors or pytorch_model.bin) or a local run's folder "
                                       "(.hydra/config.yaml + checkpoints-meta/checkpoint.pth, EMA applied)"),
    Family("mdlm-sedd", "sedd", "kuleshov-group/mdlm", MDLM_COMMIT, "apache-2.0",
           lambda s: s.layout == "lightning" and _parameterization(s) == "sedd"
           and _has("backbone.vocab_embed.embedding", "backbone.sigma_map.mlp.0.weight")(s),
           config_mdlm_sedd, map_backbone, note="MDLM's SEDD baseline (.ckpt, parameterization sedd)"),
    Family("adlm", "adlm", "kuleshov-group/remdm (Lightning module; ADLM's layout assumed)", REMDM_COMMIT, "unknown",
           _adlm_like,
           config_adlm, map_adlm, note="assumed layout: anchor under backbone., denoiser under denoiser."),
    Family("ssdlm", "ssdlm", "xhan77/ssd-lm", SSDLM_COMMIT, "unknown",
           lambda s: s.layout == "hub" and s.hparams.get("model_type") == "roberta"
           and _has("embed_sum_layer.weight", "timestep_layer.weight", "timestep_layer.bias")(s),
           config_ssdlm, map_ssdlm, buffers=SSDLM_DERIVED, tokenizer_files=("vocab.json", "merges.txt"),
           note="its Hub layout (xhan77/ssdlm): RobertaForMaskedLM (config.json + pytorch_model.bin or "
                "model.safetensors) with embed_sum_layer.pt and timestep_layer.pt; sample-only"),
    Family("adlm-export", "", "this project (python -m pipelines.export)", "", "see the model card",
           lambda s: s.layout == "export", config_export, map_identity, buffers=(), layout="export",
           note="this project's exported folder (model_type adlm)"),
)}


def detect_family(src: Source) -> Family:
    hits = [f for f in FAMILIES.values() if f.matches(src)]
    if len(hits) != 1:
        what = "no family" if not hits else f"several families ({', '.join(f.name for f in hits)})"
        keys = ", ".join(list(src.tensors)[:6])
        raise ImportRefused(f"{what} matches this {src.layout} checkpoint (first keys: {keys}); pass --family "
                            f"({', '.join(FAMILIES)})")
    return hits[0]


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ImportRefused(f"unknown family {name!r}: use one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


MODEL_TYPES = {"mdlm": "mdlm", "bd3lm": "bd3lm", "adlm": "adlm-export"}
LAYOUTS = {"lightning": "a Lightning .ckpt", "hub": "a Hub-layout folder", "run": "a SEDD training run",
           "export": "this project's export folder"}
"""A Hub folder's own ``config.json`` ``model_type`` -> the family that reads it."""


def chosen_family(name: str | None, src: Source) -> Family:
    """The family ``--family name`` asks for (None: recognised, ``detect_family``). A folder whose own
    ``model_type`` names another family is refused: read as ``name`` it would be a different model (a BD3-LM read
    as MDLM attends to every position instead of block by block)."""
    if name is None:
        return detect_family(src)
    fam = family(name)
    if (fam.layout == "export") != (src.layout == "export"):
        theirs = ("this project's export folders" if fam.layout == "export" else
                  "released checkpoints, not this project's export folders")
        raise ImportRefused(f"--family {name} reads {theirs}; this source is {LAYOUTS.get(src.layout, src.layout)}: "
                            "leave --family out (it is recognised from the file) or pass its own family")
    own = MODEL_TYPES.get(str(src.hparams.get("model_type"))) if src.layout in ("hub", "export") else None
    if own is not None and own != fam.name:
        raise ImportRefused(f"--family {name} does not fit: the folder's config.json says model_type "
                            f"{src.hparams['model_type']!r}, family {own}; pass --family {own} (or leave --family out)")
    return fam


# --------------------------------------------------------------------------------------------------
# Conversion


def weights(src: Source, fam: Family) -> dict[str, torch.Tensor]:
    """The tensors to load: a Lightning checkpoint's EMA shadow parameters put in place of its parameters
    (the EMA lists the module's parameters in order: the state dict's keys less its buffers)."""
    state = dict(src.tensors)
    if src.ema is None:
        return state
    params = [k for k in state if not k.endswith(fam.buffers)]
    if len(params) != len(src.ema) or any(state[k].shape != e.shape for k, e in zip(params, src.ema, strict=True)):
        raise ImportRefused(f"the checkpoint's EMA ({len(src.ema)} tensors) does not line up with its "
                            f"{len(params)} parameters: not a {fam.name} checkpoint as its reference saves it")
    for k, e in zip(params, src.ema, strict=True):
        state[k] = e
    return state


def model_config(src: Source, fam: Family, vocab_size: int, mask_id: int) -> ModelConfig:
    fields = fam.config(src)
    if not fields.get("kind"):
        fields["kind"] = src.hparams["model"]["kind"]
    try:
        return ModelConfig.from_dict({**fields, "vocab_size": vocab_size, "mask_id": mask_id})
    except ValueError as e:
        raise ImportRefused(f"the checkpoint's hyper-parameters make no valid model: {e}") from None


def embedding_width(src: Source, fam: Family) -> int:
    """Rows of the checkpoint's token embedding (vocabulary plus an appended mask); ImportRefused when a Hub
    folder's config.json states another ``vocab_size`` (``from_pretrained`` refuses such a folder too)."""
    for k, v in src.tensors.items():
        if k.endswith(("vocab_embed.embedding", "vocab_embed.weight", "embeddings.word_embeddings.weight")) \
                and "denoiser" not in k:
            rows = int(v.shape[0])
            stated = src.hparams.get("vocab_size") if src.layout == "hub" else None
            if stated is not None and stated != rows:
                raise ImportRefused(f"config.json says vocab_size {stated!r} but the weights' token embedding {k} has "
                                    f"{rows} rows: the config and the weights are not one model (download the folder "
                                    "again)")
            return rows
    raise ImportRefused(f"no token embedding (vocab_embed) in this {fam.name} checkpoint")


def _check_rotary(key: str, value: torch.Tensor) -> str | None:
    d = value.numel() * 2
    expected = 1.0 / (10000.0 ** (torch.arange(0, d, 2).double() / d))
    if not torch.allclose(value.double(), expected, rtol=1e-6, atol=0):
        return f"{key} (rotary frequencies other than base 10000)"
    return None


def summarise_keys(keys: list[str], limit: int = 12) -> str:
    """``keys`` comma-separated; past ``limit``, grouped by their pattern with block indices as ``N``
    (``denoiser.blocks.N.attn_qkv.weight x12``), so that a wholly unmatched network stays one readable line."""
    if len(keys) <= limit:
        return ", ".join(keys)
    groups: dict[str, int] = {}
    for k in keys:
        pattern = re.sub(r"\.\d+\.", ".N.", k)
        groups[pattern] = groups.get(pattern, 0) + 1
    return ", ".join(f"{p} x{n}" if n > 1 else p for p, n in groups.items())


def convert(src: Source, fam: Family, vocab_size: int, mask_id: int) -> tuple[nn.Module, ModelConfig]:
    """Our network with every tensor of ``src`` in place, in eval mode; ImportRefused (one line listing the
    unmatched keys) when the layout does not map completely: nothing is half loaded."""
    cfg = model_config(src, fam, vocab_size, mask_id)
    state = weights(src, fam)
    have = sum(v.numel() for v in state.values())
    want = oversized(cfg, have)
    if want is not None:  # a config edited to ask for far more than the file holds: refused before it is built
        raise ImportRefused(f"the checkpoint's config describes a {cfg.kind} network of {want:,} parameters but its "
                            f"weights hold {have:,} values: the config does not belong to these weights")
    model = build_model(cfg)
    ours = model.state_dict()
    mapped: dict[str, torch.Tensor] = {}
    unmatched: list[str] = []
    for key, value in state.items():
        target = fam.map_key(key)
        if target == DROP:
            bad = _check_rotary(key, value) if key.endswith("rotary_emb.inv_freq") else None
            if bad:
                unmatched.append(bad)
            continue
        if target is None or target not in ours:
            unmatched.append(key)
        elif ours[target].shape != value.shape:
            unmatched.append(f"{key} {tuple(value.shape)} (ours {target} {tuple(ours[target].shape)})")
        else:
            mapped[target] = value
    missing = [k for k in ours if k not in mapped]
    if unmatched or missing:
        parts = []
        if unmatched:
            parts.append(f"{len(unmatched)} unmatched key(s): {summarise_keys(unmatched)}")
        if missing:
            parts.append(f"{len(missing)} of our key(s) left empty: {summarise_keys(missing)}")
        raise ImportRefused(f"the {fam.name} layout does not map completely onto {cfg.kind}: {'; '.join(parts)}")
    model.load_state_dict({k: v.to(ours[k].dtype) for k, v in mapped.items()}, strict=True)
    return model.eval(), cfg


def key_tree(tensors: dict[str, torch.Tensor]) -> list[str]:
    """One line per tensor, ``key  shape  dtype``, for ``--inspect``."""
    width = max((len(k) for k in tensors), default=0)
    return [f"{k:<{width}}  {tuple(v.shape)}  {str(v.dtype).removeprefix('torch.')}" for k, v in tensors.items()]


__all__ = ["DROP", "FAMILIES", "PICKLE_SUFFIXES", "Family", "ImportRefused", "Source", "chosen_family", "convert",
           "detect_family", "embedding_width", "family", "key_tree", "model_config", "normalise_key", "read_source",
           "weights"]
