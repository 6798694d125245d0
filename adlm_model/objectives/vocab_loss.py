"""The vocabulary-wide losses without their logits: linear projection, log-softmax and loss fused over chunks of
rows, so that the float32 logits of B x L x V (13 GB at batch 64, L = 1024, the GPT-2 vocabulary) never exist.

Every objective of the model kinds is a weighted sum over positions of terms that read one row of logits
``o = h W^T + b`` only through two numbers: ``lse``, the log-sum-exp of the row over the columns other than an
excluded one (SUBS's mask column), and ``o_y``, the logit of the target token. With per-row weights ``a``, ``c``
and shifts ``s`` that the caller computes from the noise (they carry no gradient):

- ``ce`` (SUBS's NELBO, the AR NLL, ADLM's anchor term): ``sum_i a_i (lse_i - o_{i,y_i})``;
- ``exp`` (SEDD's score entropy): ``sum_i a_i exp(lse_i - s_i) - c_i o_{i,y_i}``.

``linear_loss`` takes the hidden states and the projection and computes the gradients of the sum with respect to
them chunk by chunk during the forward pass (the gradient of a row's logits, ``d_i softmax_i - c_i onehot(y_i)``,
needs only that row), as Liger-Kernel's fused linear cross-entropy does: a chunk's logits are freed before the next
is computed, the backward pass scales the stored gradients, and no matmul is recomputed (Liger's kernel itself
takes per-class weights, not SUBS's per-row 1/t, so it is not used). ``logits_loss`` does the
same from logits that exist anyway (ADLM's anchor logits, which feed its denoiser), without their float32 copy.
Both are plain torch, so ``torch.compile`` traces them without a graph break; under autocast the matmuls run in
the autocast dtype as ``nn.Linear``'s would, and the softmax in float32.
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 2**28
"""Logit entries per chunk (1 GiB in float32): rows per chunk = this / the vocabulary width (5,341 rows of the GPT-2
vocabulary: 13 chunks at batch 64, L = 1024). Few chunks keep the compiled graph, which unrolls them, small."""


def _rows_per_chunk(n: int, width: int, chunk_elements: int) -> int:
    return max(1, min(n, chunk_elements // max(width, 1)))


def _row_terms(lf: torch.Tensor, target: torch.Tensor, exclude: int | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse over the non-excluded columns, target logit, the rows with the excluded column at -inf) of float32
    logits rows (n, V)."""
    if exclude is not None:
        lf = lf.index_fill(-1, torch.tensor([exclude], device=lf.device), float("-inf"))
    return torch.logsumexp(lf, dim=-1), lf.gather(-1, target[:, None]).squeeze(-1), lf


def _reduce(lse: torch.Tensor, tgt: torch.Tensor, a: torch.Tensor, c: torch.Tensor, s: torch.Tensor | None,
            mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's loss and d loss / d lse per row (the softmax's coefficient in the row's logit gradient)."""
    if mode == "ce":
        return (a * (lse - tgt)).sum(), a
    e = torch.exp(lse - s)
    return (a * e - c * tgt).sum(), a * e


def _check(mode: str, a: torch.Tensor, c: torch.Tensor | None, s: torch.Tensor | None) -> None:
    if mode not in ("ce", "exp"):
        raise ValueError(f"mode must be ce or exp, got {mode!r}")
    if mode == "exp" and (c is None or s is None):
        raise ValueError("mode exp needs the target weights c and the shifts s")


class _LinearLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                a: torch.Tensor, c: torch.Tensor | None, s: torch.Tensor | None, exclude: int | None, mode: str,
                chunk_elements: int) -> torch.Tensor:
        c = a if c is None else c  # one tensor never goes in twice (dynamo refuses a duplicated input)
        n, width = h.shape[0], weight.shape[0]
        rows = _rows_per_chunk(n, width, chunk_elements)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_b = torch.zeros(width, dtype=torch.float32, device=weight.device) if bias is not None else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, n, rows):
            end = min(n, start + rows)
            hc = h[start:end]
            logits = torch.nn.functional.linear(hc, weight, bias)  # the autocast dtype under autocast
            lse, tgt, lf = _row_terms(logits.float(), target[start:end], exclude)
            part, d = _reduce(lse, tgt, a[start:end], c[start:end], None if s is None else s[start:end], mode)
            total = total + part
            # d loss / d logits = d softmax - c onehot(target) (the excluded column's softmax is 0)
            g = torch.softmax(lf, dim=-1) * d[:, None]
            g = g.scatter_add(-1, target[start:end, None], -c[start:end, None])
            gl = g.to(logits.dtype)
            grad_h[start:end] = (gl @ weight.to(gl.dtype)).to(h.dtype)
            grad_w += (gl.t() @ hc.to(gl.dtype)).float()
            if grad_b is not None:
                grad_b += g.sum(0)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.has_bias = bias is not None
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        grad_h, grad_w, grad_b = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype)
        gw = (grad_w * grad_out).to(ctx.dtypes[0])
        gb = (grad_b * grad_out).to(ctx.dtypes[1]) if ctx.has_bias else None
        return gh, gw, gb, None, None, None, None, None, None, None


def _plain(logits_of: object, n: int, width: int, target: torch.Tensor, a: torch.Tensor, c: torch.Tensor,
           s: torch.Tensor | None, exclude: int | None, mode: str, chunk_elements: int) -> torch.Tensor:
    """The same sum without gradients (validation, or nothing that needs one), chunk by chunk."""
    rows = _rows_per_chunk(n, width, chunk_elements)
    total = torch.zeros((), dtype=torch.float32, device=target.device)
    for start in range(0, n, rows):
        end = min(n, start + rows)
        lse, tgt, _ = _row_terms(logits_of(start, end).float(), target[start:end], exclude)
        total = total + _reduce(lse, tgt, a[start:end], c[start:end], None if s is None else s[start:end], mode)[0]
    return total


def linear_loss(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                a: torch.Tensor, *, c: torch.Tensor | None = None, s: torch.Tensor | None = None,
                exclude: int | None = None, mode: str = "ce", chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """The weighted loss of the logits ``h W^T + b`` (module docstring), float32, summed over rows; ``h`` (..., H),
    ``target``, ``a``, ``c``, ``s`` shaped like ``h`` without its last dimension. ``c`` defaults to ``a`` (``ce``).
    Rows whose weights are 0 still cost their matmul: the caller keeps the rows it needs."""
    _check(mode, a, c, s)
    hidden = h.shape[-1]
    h2, t2 = h.reshape(-1, hidden), target.reshape(-1)
    a2 = a.reshape(-1).float().detach()
    c2 = None if c is None else c.reshape(-1).float().detach()
    s2 = None if s is None else s.reshape(-1).float().detach()
    needs_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad
                                              or (bias is not None and bias.requires_grad))
    if needs_grad:
        return _LinearLoss.apply(h2, weight, bias, t2, a2, c2, s2, exclude, mode, chunk_elements)
    return _plain(lambda i, j: torch.nn.functional.linear(h2[i:j], weight, bias), h2.shape[0], weight.shape[0], t2,
                  a2, a2 if c2 is None else c2, s2, exclude, mode, chunk_elements)


class _LogitsLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, a: torch.Tensor, exclude: int | None,
                chunk_elements: int) -> torch.Tensor:
        n, width = logits.shape
        rows = _rows_per_chunk(n, width, chunk_elements)
        grad = torch.empty_like(logits)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, n, rows):
            end = min(n, start + rows)
            lse, tgt, lf = _row_terms(logits[start:end].float(), target[start:end], exclude)
            total = total + (a[start:end] * (lse - tgt)).sum()
            g = torch.softmax(lf, dim=-1) * a[start:end, None]
            grad[start:end] = g.scatter_add(-1, target[start:end, None], -a[start:end, None]).to(logits.dtype)
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return grad * grad_out.to(grad.dtype), None, None, None, None


def logits_loss(logits: torch.Tensor, target: torch.Tensor, a: torch.Tensor, *, exclude: int | None = None,
                chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """``sum_i a_i (lse_i - o_{i,y_i})`` of given logits (..., V), float32, without a float32 copy of them (their
    gradient is kept in their own dtype)."""
    width = logits.shape[-1]
    l2, t2, a2 = logits.reshape(-1, width), target.reshape(-1), a.reshape(-1).float().detach()
    if torch.is_grad_enabled() and logits.requires_grad:
        return _LogitsLoss.apply(l2, t2, a2, exclude, chunk_elements)
    return _plain(lambda i, j: l2[i:j], l2.shape[0], width, t2, a2, a2, None, exclude, "ce", chunk_elements)


def full_linear_loss(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                     a: torch.Tensor, *, c: torch.Tensor | None = None, s: torch.Tensor | None = None,
                     exclude: int | None = None, mode: str = "ce") -> torch.Tensor:
    """``linear_loss`` through the whole float32 logits and autograd: the reference the fused path is tested
    against, and what ``vocab_chunks: false`` runs."""
    _check(mode, a, c, s)
    lf = torch.nn.functional.linear(h, weight, bias).float()
    if exclude is not None:
        lf = lf.index_fill(-1, torch.tensor([exclude], device=lf.device), float("-inf"))
    lse = torch.logsumexp(lf, dim=-1)
    tgt = lf.gather(-1, target[..., None]).squeeze(-1)
    a = a.float().detach()
    if mode == "ce":
        return (a * (lse - tgt)).sum()
    return (a * torch.exp(lse - s.float()) - c.float().detach() * tgt).sum()


__all__ = ["CHUNK_ELEMENTS", "full_linear_loss", "linear_loss", "logits_loss"]
