"""A synthetic language with exact likelihood where anchors matter: the ground-truth testbed.

Generative process of one row of ``length`` tokens (``BOS x_1 .. x_n EOS``, ``n = length - 2``):

1. a latent **class** ``c`` is drawn uniformly from ``n_classes``; it selects the transition matrix ``P_c``
   of a hidden Markov chain over ``n_states`` states (``h_1 ~ pi_c``, ``h_t ~ P_c[h_{t-1}]``);
2. at each content position, while fewer than ``max_anchors`` anchors were emitted, the position holds an
   **anchor** with probability ``anchor_rate``: one of the ``anchors_per_class`` symbols of class ``c``
   (uniformly). Otherwise it holds a **content** symbol drawn from the emission ``E[h_t]`` (shared by the
   classes). The chain advances at every position, anchors included.

So every row has at most ``max_anchors <= tau`` anchor tokens: each occurs at most ``tau`` times and is an
anchor under ADLM's rule (docs/design/method.md, section 2), and one visible anchor reveals ``c`` exactly, on which the
dynamics of every other token depend. Context matters everywhere (sparse transitions and emissions), so the
unigram floors sit far above the entropy.

Every quantity is exact: the forward algorithm over ``(class, anchors so far, hidden state)`` gives
``log p(row)`` and the marginal of any visible subset (masked positions summed out); forward-backward gives
``p(x^l | visible tokens)`` at every position, an exact oracle denoiser (MDLM's any-order identity, docs/design/method.md
section 1). Only the entropy is a Monte-Carlo mean, of exact log-probabilities of generated rows, with its
standard error. All token ids are the MODEL's ids (what the shards hold): ``<pad> <bos> <eos> <mask>`` are 0-3,
content symbols follow, then the anchor symbols (``vocab_size`` ids in all; the mask id lies inside).

That is the ``anchored`` preset (the default). ``preset = "natural"`` is another language, as exact, with natural
text's confidence profile (``natural.py``, which registers itself in ``PRESET_CLASSES``); ``Testbed(config)``
builds whichever the config names."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch
import torch.nn as nn

PAD_ID, BOS_ID, EOS_ID, MASK_ID = 0, 1, 2, 3
N_SPECIALS = 4
SPECIAL_NAMES = ("<pad>", "<bos>", "<eos>", "<mask>")
CHUNK = 256
"""Rows per forward-backward pass of ``conditionals`` (its messages are rows x L x states)."""


class TestbedError(ValueError):
    """An invalid testbed configuration or input; the message names the field and the fix."""

    __test__ = False  # not a pytest test class, whatever its name


TESTBED_PRESETS = ("anchored", "natural")
NATURAL_DEFAULTS: dict[str, Any] = {"content_vocab": 256}  # the defaults that differ under preset = "natural"
PRESET_CLASSES: dict[str, type] = {}  # preset -> its Testbed subclass (anchored: Testbed itself)
_ENTROPY: dict[TestbedConfig, Estimate] = {}  # config -> H(X) per row: a language built again reuses it


@dataclass(frozen=True)
class TestbedConfig:
    """The synthetic language (module docstring). Equal configs give the same language on every machine."""

    __test__ = False

    seed: int = 0
    """Seed of the language's parameters (pi, P, E); rows are drawn with their own seed (``Testbed.sample``)."""
    length: int = 64
    """Row length L, BOS and EOS included (the model's seq_len)."""
    content_vocab: int = 48
    """Content symbols (ids 4 .. 4 + content_vocab - 1)."""
    n_classes: int = 16
    """Values of the latent class c that the anchors reveal."""
    n_states: int = 8
    """Hidden states of each class's Markov chain."""
    anchors_per_class: int = 2
    """Anchor symbols of each class (disjoint between classes)."""
    max_anchors: int = 3
    """At most this many anchor tokens a row (<= tau, so each is an anchor under ADLM's rule)."""
    anchor_rate: float = 0.05
    """Probability that a content position holds an anchor, while fewer than max_anchors were emitted."""
    tau: int = 5
    """ADLM's anchor threshold the language is built for (docs/design/method.md, section 2)."""
    transition_concentration: float = 0.05
    """Dirichlet concentration of each row of P_c: small = few likely successors (strong local structure)."""
    emission_concentration: float = 0.1
    """Dirichlet concentration of each state's emission over the content symbols."""
    smoothing: float = 1e-3
    """Mass mixed uniformly into every distribution, so every row of the right shape has positive probability."""
    entropy_rows: int = 30000
    """Generated rows whose exact log-probabilities estimate the entropy (standard error well below 0.1%)."""
    preset: str = "anchored"
    """``anchored`` (module docstring) or ``natural`` (natural.py, with the four fields below)."""
    n_words: int = 512
    max_word_len: int = 4
    word_length_decay: float = 0.5
    word_concentration: float = 0.03
    """``natural``: its lexicon, spellings and word chain (natural.py). These defaults (with 256 symbols)
    match a real LM's next-token confidence profile (benchmarks/testbed_calibration.py)."""

    def validate(self) -> TestbedConfig:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise TestbedError(msg)

        need(self.length >= 3, f"length must be >= 3 (BOS, content, EOS), got {self.length}")
        need(self.content_vocab >= 2, f"content_vocab must be >= 2, got {self.content_vocab}")
        need(self.n_classes >= 1 and self.n_states >= 1, "n_classes and n_states must be >= 1")
        need(self.anchors_per_class >= 1, f"anchors_per_class must be >= 1, got {self.anchors_per_class}")
        need(0 <= self.max_anchors <= self.tau,
             f"max_anchors {self.max_anchors} must lie in [0, tau={self.tau}] so anchors meet ADLM's rule")
        need(0.0 <= self.anchor_rate < 1.0, f"anchor_rate must be in [0, 1), got {self.anchor_rate}")
        need(self.transition_concentration > 0 and self.emission_concentration > 0, "concentrations must be > 0")
        need(0.0 < self.smoothing < 1.0, f"smoothing must be in (0, 1), got {self.smoothing}")
        need(self.entropy_rows >= 100, f"entropy_rows must be >= 100, got {self.entropy_rows}")
        need(self.preset in TESTBED_PRESETS, f"preset must be one of {', '.join(TESTBED_PRESETS)}, got {self.preset!r}")
        need(self.n_words >= 1 and self.max_word_len >= 1, "n_words and max_word_len must be >= 1")
        need(self.word_length_decay > 0 and self.word_concentration > 0,
             "word_length_decay and word_concentration must be > 0")
        return self

    @property
    def vocab_size(self) -> int:
        if self.preset == "natural":
            return N_SPECIALS + self.content_vocab
        return N_SPECIALS + self.content_vocab + self.n_classes * self.anchors_per_class

    @classmethod
    def natural(cls, **fields: Any) -> TestbedConfig:  # the natural preset, its defaults overridden by fields
        return cls(**{**NATURAL_DEFAULTS, **fields, "preset": "natural"}).validate()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TestbedConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise TestbedError(f"unknown testbed config key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if d.get("preset") == "natural":
            d = {**NATURAL_DEFAULTS, **d}
        return cls(**d).validate()


@dataclass(frozen=True)
class Estimate:
    """A Monte-Carlo mean of exact per-row quantities, with its standard error."""

    mean: float
    se: float
    n: int


def _mean_se(x: torch.Tensor) -> Estimate:
    x = x.double()
    return Estimate(float(x.mean()), float(x.std(unbiased=True) / math.sqrt(x.numel())), int(x.numel()))


class Testbed:
    """The language of a ``TestbedConfig``: sampling, exact log-probabilities, marginals and conditionals."""

    __test__ = False

    def __new__(cls, config: TestbedConfig | None = None) -> Testbed:
        sub = PRESET_CLASSES.get(config.preset, cls) if cls is Testbed and config is not None else cls
        return super().__new__(sub)

    def __init__(self, config: TestbedConfig | None = None) -> None:
        self.config = (config or TestbedConfig()).validate()
        c = self.config
        rng = np.random.default_rng(np.random.SeedSequence([c.seed, 0x7E57BED]))
        K, S, V = c.n_classes, c.n_states, c.content_vocab

        def dirichlet(alpha: float, shape: tuple[int, ...], n: int) -> np.ndarray:
            p = rng.dirichlet(np.full(n, alpha), size=shape)
            p = np.nan_to_num(p, nan=1.0 / n)  # an underflowing tiny-alpha draw: uniform
            p = p / p.sum(-1, keepdims=True)
            return (1 - c.smoothing) * p + c.smoothing / n

        self.prior = torch.full((K,), 1.0 / K, dtype=torch.float64)
        self.pi = torch.from_numpy(dirichlet(1.0, (K,), S))
        self.P = torch.from_numpy(dirichlet(c.transition_concentration, (K, S), S))  # (K, S, S)
        self.E = torch.from_numpy(dirichlet(c.emission_concentration, (S,), V))  # (S, V), shared by the classes
        A1 = c.max_anchors + 1
        self.rho = torch.tensor([c.anchor_rate if k < c.max_anchors else 0.0 for k in range(A1)], dtype=torch.float64)
        self.content_lo = N_SPECIALS
        self.anchor_lo = N_SPECIALS + V
        na = K * c.anchors_per_class
        emit = torch.zeros(K, na, dtype=torch.float64)  # p(anchor symbol | class c)
        for k in range(K):
            emit[k, k * c.anchors_per_class:(k + 1) * c.anchors_per_class] = 1.0 / c.anchors_per_class
        self.anchor_emit = emit

    # ------------------------------------------------------------------------------------------------ ids

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Testbed:
        return cls(TestbedConfig.from_dict(d))

    def to_dict(self) -> dict[str, Any]:
        return self.config.to_dict()

    @property
    def length(self) -> int:
        return self.config.length

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    bos_id, eos_id, pad_id, mask_id = BOS_ID, EOS_ID, PAD_ID, MASK_ID

    def token_names(self) -> list[str]:
        """The symbol of every id: specials, ``c00 ..`` content, ``a<class>_<j>`` anchors (the tokenizer's vocabulary)."""
        c = self.config
        names = list(SPECIAL_NAMES) + [f"c{i:02d}" for i in range(c.content_vocab)]
        names += [f"a{k:02d}_{j}" for k in range(c.n_classes) for j in range(c.anchors_per_class)]
        return names

    def is_anchor_token(self, rows: torch.Tensor) -> torch.Tensor:
        """True where a token is one of the anchor symbols (the latent-revealing tokens)."""
        return rows >= self.anchor_lo

    # ------------------------------------------------------------------------------------------------ sampling

    def sample(self, n: int, seed: int) -> torch.LongTensor:
        """``n`` rows ``(n, length)`` as the shards hold them, drawn from the generative process; deterministic in
        ``seed`` (and the config)."""
        if n < 0:
            raise TestbedError(f"n must be >= 0, got {n}")
        c = self.config
        rng = np.random.default_rng(np.random.SeedSequence([c.seed, 0x5A3, int(seed)]))
        L, m = c.length, c.anchors_per_class
        out = np.empty((n, L), dtype=np.int64)
        out[:, 0], out[:, -1] = BOS_ID, EOS_ID
        if n == 0:
            return torch.from_numpy(out)

        def draw(probs: np.ndarray) -> np.ndarray:  # one categorical per row of probs
            u = rng.random(probs.shape[0])[:, None]
            return np.minimum((probs.cumsum(-1) < u).sum(-1), probs.shape[-1] - 1)

        P, E, pi, rho = self.P.numpy(), self.E.numpy(), self.pi.numpy(), self.rho.numpy()
        cls = rng.integers(0, c.n_classes, n)
        h = draw(pi[cls])
        k = np.zeros(n, dtype=np.int64)
        for t in range(1, L - 1):
            if t > 1:
                h = draw(P[cls, h])
            is_anchor = rng.random(n) < rho[k]
            content = draw(E[h]) + self.content_lo
            anchor = self.anchor_lo + cls * m + rng.integers(0, m, n)
            out[:, t] = np.where(is_anchor, anchor, content)
            k = k + is_anchor
        return torch.from_numpy(out)

    # ------------------------------------------------------------------------------------------------ exact

    def _factors(self, z: torch.Tensor, masked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per content position, the emission factors: content (B, n, S), anchor (B, n, K), and the log-factor of
        the framing (B,): 0 when BOS/EOS are right or masked, -inf otherwise."""
        c = self.config
        x = z[:, 1:-1]
        msk = masked[:, 1:-1]
        is_content = (x >= self.content_lo) & (x < self.anchor_lo) & ~msk
        is_anchor = (x >= self.anchor_lo) & (x < self.vocab_size) & ~msk
        v = (x - self.content_lo).clamp(0, c.content_vocab - 1)
        f_content = self.E.T[v]  # (B, n, S)
        f_content = torch.where(is_content[..., None], f_content, torch.zeros_like(f_content))
        f_content = torch.where(msk[..., None], torch.ones_like(f_content), f_content)
        a = (x - self.anchor_lo).clamp(0, self.anchor_emit.shape[1] - 1)
        f_anchor = self.anchor_emit.T[a]  # (B, n, K)
        f_anchor = torch.where(is_anchor[..., None], f_anchor, torch.zeros_like(f_anchor))
        f_anchor = torch.where(msk[..., None], torch.ones_like(f_anchor), f_anchor)
        ok0 = masked[:, 0] | (z[:, 0] == BOS_ID)
        ok1 = masked[:, -1] | (z[:, -1] == EOS_ID)
        frame = torch.where(ok0 & ok1, 0.0, float("-inf")).double()
        return f_content, f_anchor, frame

    def _emit(self, pred: torch.Tensor, fc: torch.Tensor, fa: torch.Tensor) -> torch.Tensor:
        """alpha_t(c, k, h) from pred(c, k, h) = p(state before emitting at t) and the emission factors at t:
        a content emission keeps k, an anchor moves k to k + 1."""
        A1 = self.rho.shape[0]
        stay = (1 - self.rho).view(1, 1, A1, 1) * fc[:, None, None, :]  # (B, 1, A1, S)
        new = pred * stay
        if A1 > 1:
            step = self.rho[:-1].view(1, 1, A1 - 1, 1) * fa[:, :, None, None]  # (B, K, A1 - 1, 1)
            new[:, :, 1:] += pred[:, :, :-1] * step
        return new

    def _advance(self, a: torch.Tensor, backward: bool = False) -> torch.Tensor:
        """One step of each class's chain on (B, K, A1, S): sum_h a[h] P_c[h, g] (backward: sum_g P_c[h, g] a[g]),
        as one batched matmul per class."""
        B, K, A1, S = a.shape
        m = a.permute(1, 0, 2, 3).reshape(K, B * A1, S)
        m = torch.bmm(m, self.P.transpose(1, 2) if backward else self.P)
        return m.reshape(K, B, A1, S).permute(1, 0, 2, 3)

    def _initial(self, B: int) -> torch.Tensor:
        A1 = self.config.max_anchors + 1
        pred = torch.zeros(B, self.config.n_classes, A1, self.config.n_states, dtype=torch.float64)
        pred[:, :, 0] = (self.prior[:, None] * self.pi)[None]
        return pred

    def _forward(self, z: torch.Tensor, masked: torch.Tensor, keep: bool = False
                 ) -> tuple[torch.Tensor, list[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(log p(visible), scaled alphas per content position when ``keep``, factors)."""
        fc, fa, frame = self._factors(z, masked)
        B, n = fc.shape[0], fc.shape[1]
        logz = frame.clone()
        alphas: list[torch.Tensor] = []
        alpha = None
        for t in range(n):
            pred = self._initial(B) if alpha is None else self._advance(alpha)
            new = self._emit(pred, fc[:, t], fa[:, t])
            s = new.sum(dim=(1, 2, 3))
            logz = logz + torch.log(s)
            alpha = new / s.clamp_min(1e-300)[:, None, None, None]
            if keep:
                alphas.append(alpha)
        return logz, alphas, (fc, fa, frame)

    def _check(self, z: torch.Tensor) -> torch.Tensor:
        z = torch.as_tensor(z)
        if z.dim() != 2 or z.shape[1] != self.length:
            raise TestbedError(f"rows must have shape (n, {self.length}), got {tuple(z.shape)}")
        return z.long().cpu()

    def log_prob(self, rows: torch.Tensor) -> torch.Tensor:
        """Exact ``log p(row)`` (n,), float64, by the forward algorithm; -inf for rows the language cannot emit."""
        z = self._check(rows)
        fc, fa, frame = self._factors(z, torch.zeros_like(z, dtype=torch.bool))
        # Every token visible: the anchor count before each position is known, so the forward runs over
        # (class, hidden state) only, each emission weighted by rho of that count.
        anc = self.is_anchor_token(z[:, 1:-1])
        k = (anc.long().cumsum(1) - anc.long()).clamp(max=self.config.max_anchors)
        rho = self.rho[k]  # (B, n)
        logz = frame.clone()
        alpha = (self.prior[:, None] * self.pi)[None].expand(z.shape[0], -1, -1)
        for t in range(fc.shape[1]):
            if t > 0:
                alpha = torch.bmm(alpha.transpose(0, 1), self.P).transpose(0, 1)
            f = torch.where(anc[:, t, None, None], (rho[:, t, None] * fa[:, t])[:, :, None],
                            ((1 - rho[:, t, None]) * fc[:, t])[:, None, :])
            new = alpha * f
            s = new.sum(dim=(1, 2))
            logz = logz + torch.log(s)
            alpha = new / s.clamp_min(1e-300)[:, None, None]
        return logz

    def log_marginal(self, z: torch.Tensor, mask_id: int = MASK_ID) -> torch.Tensor:
        """Exact log-probability (n,) of the visible tokens of ``z``, the positions equal to ``mask_id`` summed out.

        ``log p(continuation | context) = log_marginal(ctx + cont) - log_marginal(ctx + masked cont)``.
        """
        z = self._check(z)
        return self._forward(z, z == mask_id)[0]

    def conditionals(self, z: torch.Tensor, mask_id: int = MASK_ID, width: int | None = None,
                     strict: bool = False) -> torch.Tensor:
        """Exact ``log p(x^l | visible tokens of z)`` at every position, (B, L, width) float64 (``width`` defaults
        to ``vocab_size``; the mask column is -inf). At visible positions a one-hot (log 1 = 0 on the token).

        A row whose visible tokens have probability 0 has no conditional (a sampler that unmasks positions in
        parallel can draw, e.g., anchors of two classes): its masked positions get the position marginals
        ``p(x^l)`` instead, or, with ``strict``, TestbedError is raised."""
        z = self._check(z)
        width = width or self.vocab_size
        if width < self.vocab_size:
            raise TestbedError(f"width {width} is below the testbed's vocab_size {self.vocab_size}")
        if z.shape[0] > CHUNK:  # forward-backward keeps every position's messages: bound the memory
            return torch.cat([self.conditionals(z[i:i + CHUNK], mask_id, width) for i in range(0, z.shape[0], CHUNK)])
        masked = z == mask_id
        logz, alphas, (fc, fa, frame) = self._forward(z, masked, keep=True)
        bad = torch.isneginf(logz)
        if bad.any():
            if strict:
                raise TestbedError("the visible tokens of a row have probability 0 under the testbed: no conditional")
            z_msg = torch.where(bad[:, None], torch.full_like(z, mask_id), z)  # those rows: nothing visible
            logz, alphas, (fc, fa, frame) = self._forward(z_msg, z_msg == mask_id, keep=True)
        B, n = fc.shape[0], fc.shape[1]
        rho = self.rho.view(1, 1, -1, 1)
        # Backward messages beta_t(c, k, h) = p(visible after t | state at t), scaled per row.
        betas = [torch.ones_like(alphas[0])] * n
        beta = betas[-1]
        for t in range(n - 2, -1, -1):
            b1 = beta * (1 - rho) * fc[:, t + 1][:, None, None, :]
            b2 = torch.nn.functional.pad(beta[:, :, 1:], (0, 0, 0, 1)) * rho * fa[:, t + 1][:, :, None, None]
            beta = self._advance(b1 + b2, backward=True)
            beta = beta / beta.sum(dim=(1, 2, 3)).clamp_min(1e-300)[:, None, None, None]
            betas[t] = beta
        alpha_prev = torch.stack([self._initial(B)] + [self._advance(a) for a in alphas[:-1]], 1)
        beta_all = torch.stack(betas, 1)  # (B, n, K, A1, S)
        rho5 = self.rho.view(1, 1, 1, -1, 1)
        w_content = alpha_prev * (1 - rho5) * beta_all
        content = torch.einsum("btckh,hv->btv", w_content, self.E)
        beta_next = torch.nn.functional.pad(beta_all[:, :, :, 1:], (0, 0, 0, 1))
        w_anchor = (alpha_prev * rho5 * beta_next).sum(dim=(3, 4))  # (B, n, K)
        anchor = torch.einsum("btc,ca->bta", w_anchor, self.anchor_emit)
        scores = torch.cat([content, anchor], -1)
        logp_mid = torch.log(scores) - torch.log(scores.sum(-1, keepdim=True))
        out = torch.full((B, self.length, width), float("-inf"), dtype=torch.float64)
        out[:, 1:-1, self.content_lo:self.vocab_size] = logp_mid
        out[:, 0, BOS_ID] = 0.0
        out[:, -1, EOS_ID] = 0.0
        vis = ~masked
        onehot = torch.full_like(out, float("-inf")).scatter_(-1, z[..., None].clamp(0, width - 1), 0.0)
        return torch.where(vis[..., None], onehot, out)

    # ------------------------------------------------------------------------------------------------ summaries

    @property
    def _entropy(self) -> Estimate:
        c = self.config
        if c not in _ENTROPY:  # a pure function of the frozen config (seeded rows): once per config and process
            rows = (self.sample(min(4096, c.entropy_rows - i), seed=10_000_000 + i) for i in range(0, c.entropy_rows, 4096))
            _ENTROPY[c] = _mean_se(-torch.cat([self.log_prob(r) for r in rows]))
        return _ENTROPY[c]

    def entropy_per_row(self) -> Estimate:
        """H(X) in nats per row: the mean exact NLL of ``entropy_rows`` generated rows, with its standard error."""
        return self._entropy

    def entropy_per_token(self, skip_first: bool = False) -> Estimate:
        """Exact entropy rate in nats per scored position: H(X) / L (MDLM/ADLM score all L positions) or
        H(X) / (L - 1) with ``skip_first`` (AR and BD3-LM leave position 0 out). BOS/EOS carry 0 nats."""
        e, n = self._entropy, self.length - (1 if skip_first else 0)
        return Estimate(e.mean / n, e.se / n, e.n)

    @cached_property
    def position_marginals(self) -> torch.Tensor:
        """Exact p(x^l = v) of every position (L, vocab_size), float64."""
        z = torch.full((1, self.length), MASK_ID, dtype=torch.long)
        return self.conditionals(z)[0, :, :self.vocab_size].exp()

    def floors(self, skip_first: bool = False) -> dict[str, float]:
        """Exact nats per scored position of the best unigram model and the best unigram-per-position model (what
        a model that ignores context can reach), over all L positions or (``skip_first``) positions 1..L-1."""
        p = self.position_marginals[1 if skip_first else 0:]

        def ent(q: torch.Tensor) -> torch.Tensor:
            return -(q * torch.log(q.clamp_min(1e-300))).sum(-1)

        return {"unigram": float(ent(p.mean(0))), "unigram_position": float(ent(p).mean())}

    def anchor_value(self, n: int = 2000, seed: int = 20_000_000) -> dict[str, Estimate]:
        """What knowing the anchors is worth, exactly per row and averaged over ``n`` generated rows:

        - ``mutual_information_per_token``: (log p(rest | anchors) - log p(rest)) / L, i.e. I(anchors; rest) / L;
        - ``gain_at_full_masking``: mean over non-anchor content positions of log p(x^l | anchors) - log p(x^l),
          how much better a lone token is predicted from the anchors alone (the high-masking regime);
        - ``anchors_per_row``: anchor tokens per row."""
        x = self.sample(n, seed)
        anc = self.is_anchor_token(x)
        only_anchors = torch.where(anc | (torch.arange(self.length) == 0) | (torch.arange(self.length) == self.length - 1),
                                   x, torch.full_like(x, MASK_ID))
        without_anchors = torch.where(anc, torch.full_like(x, MASK_ID), x)
        lp, lp_a, lp_rest = self.log_prob(x), self.log_marginal(only_anchors), self.log_marginal(without_anchors)
        mi = (lp - lp_a - lp_rest) / self.length
        cond = self.conditionals(only_anchors).gather(-1, x[..., None]).squeeze(-1)
        marg = torch.log(self.position_marginals).gather(-1, x.T).T  # (n, L): log p(x^l)
        inner = ~anc
        inner[:, 0] = inner[:, -1] = False
        gain = ((cond - marg) * inner).sum(1) / inner.sum(1).clamp_min(1)
        return {"mutual_information_per_token": _mean_se(mi), "gain_at_full_masking": _mean_se(gain),
                "anchors_per_row": _mean_se(anc.sum(1).double())}

    def summary(self) -> dict[str, Any]:
        """What a manifest records: the config, the exact entropy, the floors and the anchors' value (over
        ``entropy_rows / 15`` rows, at most 2,000: the forward-backward passes cost more than the forward)."""
        e, e1 = self.entropy_per_token(), self.entropy_per_token(skip_first=True)
        av = self.anchor_value(n=max(50, min(2000, self.config.entropy_rows // 15)))
        return {
            "config": self.to_dict(), "vocab_size": self.vocab_size, "length": self.length,
            "entropy_per_row": self.entropy_per_row().mean, "entropy_per_row_se": self.entropy_per_row().se,
            "entropy_per_token": e.mean, "entropy_per_token_se": e.se,
            "entropy_per_token_skip_first": e1.mean, "entropy_per_token_skip_first_se": e1.se,
            "floors": self.floors(), "floors_skip_first": self.floors(skip_first=True),
            "anchor_value": {k: {"mean": v.mean, "se": v.se, "n": v.n} for k, v in av.items()},
        }


class OracleDenoiser(nn.Module):
    """The testbed's exact conditionals with a diffusion model's forward signature (``denoiser_logits(z_t, sigma)``
    -> logits (B, L, width)): MDLM's objective run on it gives the exact NLL in expectation (docs/design/method.md, section 1).
    Logits are the exact log-probabilities (float32; -inf where impossible, mask column included)."""

    def __init__(self, testbed: Testbed, width: int | None = None, mask_id: int = MASK_ID) -> None:
        super().__init__()
        self.testbed, self.width, self.mask_id = testbed, width or testbed.vocab_size, mask_id

    def denoiser_logits(self, z_t: torch.Tensor, sigma: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        return self.testbed.conditionals(z_t, self.mask_id, self.width).float().to(z_t.device)

    forward = denoiser_logits


__all__ = ["BOS_ID", "EOS_ID", "MASK_ID", "NATURAL_DEFAULTS", "PAD_ID", "PRESET_CLASSES", "TESTBED_PRESETS",
           "Estimate", "OracleDenoiser", "Testbed", "TestbedConfig",
           "TestbedError"]
