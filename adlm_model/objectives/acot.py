"""Anchored chain-of-thought (ACoT) fine-tuning's objective: the supervised next-token NLL on the generated
positions plus ``weight`` times a cross-entropy of the outputs at the ``[ANT]`` positions, through the same LM
head, against anchor tokens taken from the trace.

Labels come aligned with the outputs (``pipelines.data.reasoning.layout``): ``sft_labels[b, p]`` is the token the
output at ``p`` must predict, ``anchor_labels[b, p]`` the anchor it must predict; ``IGNORE`` (-100) where a loss
does not read. The anchor term is a training term: at inference the ``[ANT]`` outputs are not decoded. With
``weight = 0`` the objective is pause-as-thought's (the same layout, the supervised loss alone), exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE = -100


@dataclass
class ACoTLoss:
    """What a batch gives: the loss to backpropagate and the sums and counts behind it (detached)."""

    loss: torch.Tensor
    sft_sum: torch.Tensor
    n_sft: torch.Tensor
    anchor_sum: torch.Tensor
    n_anchor: torch.Tensor
    weight: float


def _ce_sum(logits: torch.Tensor, labels: torch.Tensor, exclude: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of cross-entropies at the labelled positions, their number), in float32; ``exclude``: a column no
    label may take (the mask id of a model whose output has one), suppressed before the softmax."""
    logits = logits.float()
    if exclude is not None and exclude < logits.shape[-1]:
        logits = logits.clone()
        logits[..., exclude] = float("-inf")
    keep = labels != IGNORE
    total = F.cross_entropy(logits[keep], labels[keep], reduction="sum") if keep.any() else logits.sum() * 0
    return total, keep.sum()


def pause_as_thought_loss(logits: torch.Tensor, sft_labels: torch.Tensor, exclude: int | None = None) -> torch.Tensor:
    """The supervised NLL alone: the mean over the generated positions (the Pause-as-thought and CoT arms)."""
    total, n = _ce_sum(logits, sft_labels, exclude)
    return total / n.clamp(min=1)


def acot_loss(logits: torch.Tensor, sft_labels: torch.Tensor, anchor_labels: torch.Tensor, weight: float = 1.0,
              exclude: int | None = None) -> ACoTLoss:
    """``mean SFT NLL + weight * mean anchor CE`` over a batch of logits ``(B, L, V)`` (module docstring)."""
    sft, n_sft = _ce_sum(logits, sft_labels, exclude)
    anchor, n_anchor = _ce_sum(logits, anchor_labels, exclude)
    loss = sft / n_sft.clamp(min=1) + weight * (anchor / n_anchor.clamp(min=1))
    return ACoTLoss(loss, sft.detach().double(), n_sft, anchor.detach().double(), n_anchor, weight)


def acot_objective(model: nn.Module, input_ids: torch.Tensor, sft_labels: torch.Tensor,
                   anchor_labels: torch.Tensor, weight: float = 1.0, exclude: int | None = None) -> ACoTLoss:
    """``acot_loss`` of a causal network's logits on ``input_ids`` (the ``ar`` kind: ``model(x)`` gives them)."""
    return acot_loss(model(input_ids), sft_labels, anchor_labels, weight, exclude)


def anchor_accuracy(logits: torch.Tensor, anchor_labels: torch.Tensor) -> float:
    """The fraction of labelled ``[ANT]`` outputs whose argmax is their anchor (NaN without any)."""
    keep = anchor_labels != IGNORE
    if not keep.any():
        return float("nan")
    return float((logits.argmax(-1)[keep] == anchor_labels[keep]).float().mean())
