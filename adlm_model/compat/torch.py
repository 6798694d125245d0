"""torch's private names the model uses, and why no public API serves each."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import PrivateName

_HERE = "adlm_model/compat/torch.py"
PYTREE = PrivateName("torch.utils._pytree", None, "torch has no public pytree module: a dataclass returned by a "
                     "compiled step is registered as a pytree node through it", _HERE)
FOREACH_LERP = PrivateName("torch", "_foreach_lerp_", "the one fused in-place lerp over a list of tensors (torch's "
                           "own optimizers use it); a loop over tensor.lerp_ is the fallback", _HERE)
REBUILD_TENSOR = PrivateName("torch._utils", "_rebuild_tensor", "the function a torch pickle names to rebuild a "
                             "tensor: the safe unpickler must call exactly it", _HERE)
REBUILD_TENSOR_V2 = PrivateName("torch._utils", "_rebuild_tensor_v2", REBUILD_TENSOR.why, _HERE)
REBUILD_PARAMETER = PrivateName("torch._utils", "_rebuild_parameter", "the function a torch pickle names to "
                                "rebuild a parameter: the safe unpickler must call exactly it", _HERE)
DYNAMO_CONFIG = PrivateName("torch._dynamo", "config", "torch.compile's limits (recompiles, cache size) have no "
                            "public setter", _HERE)
DYNAMO_COUNTERS = PrivateName("torch._dynamo.utils", "counters", "torch.compile's graph-break count has no public "
                              "reader", _HERE)
PRIVATE = [PYTREE, FOREACH_LERP, REBUILD_TENSOR, REBUILD_TENSOR_V2, REBUILD_PARAMETER, DYNAMO_CONFIG, DYNAMO_COUNTERS]


def register_dataclass(cls: type) -> None:
    """Make the dataclass ``cls`` a pytree node (a compiled function may then return it)."""
    PYTREE.load().register_dataclass(cls)


def foreach_lerp_(targets: Sequence[torch.Tensor], ends: Sequence[torch.Tensor], weight: float) -> None:
    """``t.lerp_(e, weight)`` for each pair, fused where torch offers it."""
    try:
        fused = FOREACH_LERP.load()
    except ImportError:  # the fallback is exact, one kernel a tensor
        for t, e in zip(targets, ends, strict=True):
            t.lerp_(e, weight)
        return
    fused(list(targets), list(ends), weight)


def rebuild_functions() -> dict[tuple[str, str], Any]:
    """The tensor-rebuilding globals a torch pickle may name, by their (module, name) in the pickle."""
    return {(n.module, n.attr): n.load() for n in (REBUILD_TENSOR, REBUILD_TENSOR_V2, REBUILD_PARAMETER)}


def dynamo_config() -> Any:
    """torch.compile's configuration module."""
    return DYNAMO_CONFIG.load()


def dynamo_counters() -> Any:
    """torch.compile's event counters (``counters["graph_break"]``: the graph breaks so far)."""
    return DYNAMO_COUNTERS.load()
