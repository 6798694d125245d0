"""SEDD's released layout -> our ``ModelConfig`` and state dict (the released-models importer's SEDD family).

The reference (louaaron/Score-Entropy-Discrete-Diffusion, ``model/transformer.py``) saves its ``SEDD`` module's
state dict: on the Hub (``louaaron/sedd-small``, ``louaaron/sedd-medium``, written by ``PyTorchModelHubMixin``) as
``model.safetensors`` or ``pytorch_model.bin`` beside a ``config.json`` holding the whole run config (``tokens``,
``graph.type``, ``noise.type``, ``model.{hidden_size, cond_dim, length, n_blocks, n_heads, scale_by_sigma,
dropout}``); a local run's ``checkpoints-meta/checkpoint.pth`` holds it under ``model`` (saved from inside DDP as
``module.state_dict()``, so without the ``module.`` prefix; a prefixed one is read too) with its EMA's shadow
parameters under ``ema`` and the run config in the run folder's ``.hydra/config.yaml``. Reading those files is the
importer's (``reference_layouts``, whose SEDD family maps keys with ``map_sedd``); this module maps a state dict and
run config given in Python. The tokenizer is
GPT-2's (the reference's ``GPT2TokenizerFast.from_pretrained('gpt2')``, 50,257 tokens; the mask is id 50,257).

Its network is our DiT one for one (embedding, sigma timestep embedder, rotary with the values unrotated,
adaLN-modulated blocks, the final adaLN layer, output width ``tokens + 1``): only the embedding's name differs
(``vocab_embed.embedding`` is a bare parameter there). The rotary buffer (``inv_freq``) is recomputed, not read.
Only the absorbing graph with the log-linear noise and ``scale_by_sigma`` is SEDD the kind (sedd.py); the uniform
graph and the geometric noise are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..config import ConfigError, ModelConfig

PREFIXES = ("module.", "score_model.")
"""Wrappers a saved state dict may carry (DDP; a training state's attribute name)."""


def _get(d: Mapping[str, Any], path: str) -> Any:
    cur: Any = d
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            raise ConfigError(f"SEDD config: missing {path!r} (the reference's config.json of the run or the Hub "
                              "model): pass the config the weights were saved with")
        cur = cur[part]
    return cur


def sedd_config(config: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """Our ModelConfig for the reference's run config (``overrides``: fields it does not fix, e.g. ``dropout``)."""
    if "tokens" not in config and isinstance(config.get("config"), Mapping):
        config = config["config"]  # a Hub mixin's config.json may nest the init argument under its name
    graph, noise = _get(config, "graph.type"), _get(config, "noise.type")
    if graph != "absorb":
        raise ConfigError(f"SEDD graph {graph!r}: only the absorbing graph is the sedd kind (uniform is not supported)")
    if noise != "loglinear":
        raise ConfigError(f"SEDD noise {noise!r}: only the log-linear noise is the sedd kind (geometric is not "
                          "supported)")
    if not _get(config, "model.scale_by_sigma"):
        raise ConfigError("SEDD model.scale_by_sigma is false: the sedd kind is the reference's scaled score")
    tokens = int(_get(config, "tokens"))
    m = _get(config, "model")
    d = dict(kind="sedd", vocab_size=tokens, mask_id=tokens, seq_len=int(_get(config, "model.length")),
             hidden=int(m["hidden_size"]), heads=int(_get(config, "model.n_heads")),
             n_blocks=int(_get(config, "model.n_blocks")), cond_dim=int(_get(config, "model.cond_dim")),
             dropout=float(m.get("dropout", 0.1)), time_conditioning=True, noise_eps=1e-3)
    d.update(overrides)
    return ModelConfig.from_dict(d)


def sedd_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference's parameter names -> ours (``backbone.`` + the same names; the embedding renamed)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        for p in PREFIXES:
            key = key.removeprefix(p)
        if key.startswith("rotary_emb."):
            continue  # inv_freq: a function of head_dim, recomputed by our Rotary
        if key == "vocab_embed.embedding":
            key = "vocab_embed.weight"
        out["backbone." + key] = value
    return out


def sedd_from_reference(state: Mapping[str, torch.Tensor], config: Mapping[str, Any], **overrides: Any
                        ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, state dict) of our ``sedd`` kind for a reference SEDD's state dict and run config; the state
    dict loads with ``strict=True`` into ``build_model(cfg)`` (a missing or unexpected name is a ConfigError)."""
    from ..kinds import build_model

    cfg = sedd_config(config, **overrides)
    mapped = sedd_state_dict(state)
    with torch.device("meta"):
        expected = build_model(cfg).state_dict()
    missing = sorted(set(expected) - set(mapped))
    unexpected = sorted(set(mapped) - set(expected))
    if missing or unexpected:
        raise ConfigError(f"SEDD weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    bad = [k for k in expected if tuple(expected[k].shape) != tuple(mapped[k].shape)]
    if bad:
        raise ConfigError(f"SEDD weights do not match the config: shapes differ at {bad[:5]}")
    return cfg, mapped


__all__ = ["sedd_config", "sedd_from_reference", "sedd_state_dict"]
