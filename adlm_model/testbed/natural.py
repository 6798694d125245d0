"""The ``natural`` testbed preset: a language with natural text's confidence profile, as exact as the anchored one.

Natural text is mostly predictable given its neighbours: the pieces of a word after its first, fixed phrases.
The anchored preset (testbed.py) is not (its exact conditionals sit near 2.5 nats at every position), so a
confidence-threshold sampler finds nothing to unmask in parallel there. This language is built the other way:

- a **lexicon** of ``n_words`` words, each spelled as a fixed string of 1 .. ``max_word_len`` content symbols
  (p(length l) proportional to ``word_length_decay^(l - 1)``; the most frequent words get the shortest
  spellings, as a BPE vocabulary gives frequent words one token). Symbols are drawn at random, so a word's
  first symbol is shared with a few others at most and its later symbols are nearly determined by it;
- a **hidden word chain**: the first word from a Zipf law over the lexicon, each next word from its
  predecessor's successor distribution (Dirichlet around that Zipf law, with concentration per word
  ``word_concentration`` times a factor log-uniform in [0.1, 10] drawn for each word: small ones make fixed
  phrases, large ones words followed by almost anything);
- a row is ``BOS``, the first ``L - 2`` symbols of the spelled chain (the last word may be cut), ``EOS``;
- a **typo**: each symbol is replaced by a uniformly drawn content symbol with probability ``smoothing``, so
  every row of content symbols has positive probability (as the anchored preset's smoothing does).

The hidden state is (word, position inside the word): ``S = sum of the spellings' lengths`` states, a state
emits its symbol (typo aside) and moves to the word's next position, or after the last one to the first
position of a successor word. Every quantity is exact by the forward and forward-backward algorithms over those
states: ``log p(row)``, the marginal of any visible subset, ``p(x^l | visible tokens)`` at every position.
The ids: ``<pad> <bos> <eos> <mask>`` = 0-3, then the content symbols (``vocab_size = 4 + content_vocab``); no
anchor symbols (``is_anchor_token`` is all False).
"""

from __future__ import annotations

import numpy as np
import torch

from .language import (
    BOS_ID,
    CHUNK,
    EOS_ID,
    MASK_ID,
    N_SPECIALS,
    PRESET_CLASSES,
    Estimate,
    Testbed,
    TestbedConfig,
    TestbedError,
)


class _Factors:
    """The emission factor of every state at content position ``t`` (B, S), built when asked (the whole
    (B, n, S) tensor costs more memory traffic than the recursions): ``E^T[x_t]`` at a content symbol, 1 where
    masked, 0 at a foreign id."""

    def __init__(self, emit_t: torch.Tensor, v: torch.Tensor, is_content: torch.Tensor, masked: torch.Tensor) -> None:
        self.emit_t, self.v, self.is_content, self.masked = emit_t, v, is_content, masked
        self.n = v.shape[1]

    def __call__(self, t: int) -> torch.Tensor:
        return self.emit_t[self.v[:, t]] * self.is_content[:, t, None] + self.masked[:, t, None]


class NaturalTestbed(Testbed):
    """The ``natural`` preset (module docstring); ``Testbed(config)`` returns one when ``config.preset`` says so."""

    __test__ = False

    def __init__(self, config: TestbedConfig | None = None) -> None:
        self.config = (config or TestbedConfig.natural()).validate()
        c = self.config
        if c.preset != "natural":
            raise TestbedError(f"NaturalTestbed needs preset 'natural', got {c.preset!r}")
        rng = np.random.default_rng(np.random.SeedSequence([c.seed, 0x0A7A1]))
        W, V = c.n_words, c.content_vocab
        zipf = 1.0 / np.arange(1, W + 1)
        zipf /= zipf.sum()
        lengths = np.arange(1, c.max_word_len + 1)
        p_len = c.word_length_decay ** (lengths - 1.0)
        word_len = np.sort(rng.choice(lengths, size=W, p=p_len / p_len.sum()))  # frequent words first: shortest
        spellings: list[tuple[int, ...]] = []
        seen: set[tuple[int, ...]] = set()
        for n in word_len:
            for _ in range(1000):  # distinct spellings, while the short ones last
                sp = tuple(int(v) for v in rng.integers(0, V, n))
                if sp not in seen:
                    break
            seen.add(sp)
            spellings.append(sp)
        self.spellings = spellings
        # Each word's own concentration, log-uniform over two decades around word_concentration: some words
        # start fixed phrases, others are followed by almost anything (natural text's spread of entropies).
        spread = 10.0 ** rng.uniform(-1.0, 1.0, size=W)
        succ = np.stack([rng.dirichlet(c.word_concentration * a * W * zipf) for a in spread])
        succ = np.nan_to_num(succ, nan=1.0 / W)
        succ = (1 - c.smoothing) * succ / succ.sum(-1, keepdims=True) + c.smoothing / W
        self.word_start = torch.from_numpy(zipf)  # p(first word)
        self.successor = torch.from_numpy(succ)  # (W, W)
        # The states (word, position inside it), word by word.
        first = np.cumsum([0] + [len(sp) for sp in spellings])
        S = int(first[-1])
        self.state_first, self.n_states = first[:-1], S
        symbol = np.array([v for sp in spellings for v in sp], dtype=np.int64)
        last = first[1:] - 1
        T = np.zeros((S, S))
        for w in range(W):
            for j in range(first[w], last[w]):
                T[j, j + 1] = 1.0
            T[last[w], first[:-1]] = succ[w]
        pi = np.zeros(S)
        pi[first[:-1]] = zipf
        E = np.full((S, V), c.smoothing / V)
        E[np.arange(S), symbol] += 1 - c.smoothing
        self.T, self.pi, self.E = torch.from_numpy(T), torch.from_numpy(pi), torch.from_numpy(E)
        # T is a shift inside words plus the word chain between last and first positions: the messages use that
        # (a (B, W) x (W, W) product a step instead of (B, S) x (S, S)).
        self._last, self._first = torch.from_numpy(last), torch.from_numpy(first[:-1].copy())
        is_last = np.isin(np.arange(S), last)
        # 1 at a state that moves on inside its word, 0 at a word's last state: the shift inside words is then a
        # contiguous shifted product (an indexed assignment over (B, S) cost 3x as much: the forward's hot loop).
        self._moves_on = torch.from_numpy((~is_last).astype(np.float64))
        self.state_symbol, self.state_next_in_word = symbol, np.where(is_last, -1, np.arange(S) + 1)
        self.state_word = np.repeat(np.arange(W), [len(sp) for sp in spellings])
        self.content_lo = N_SPECIALS
        self.anchor_lo = N_SPECIALS + V  # no anchor symbols: every id at or above this is foreign

    def _step(self, alpha: torch.Tensor) -> torch.Tensor:
        """One step of the state chain on (B, S): ``alpha @ T``."""
        pred = torch.zeros_like(alpha)
        torch.mul(alpha[:, :-1], self._moves_on[:-1], out=pred[:, 1:])
        # A word's first state gets nothing from the shift (its predecessor is the previous word's last state), so
        # the word chain's mass is copied there, exactly as added to 0.
        return pred.index_copy_(1, self._first, alpha.index_select(1, self._last) @ self.successor)

    def _step_back(self, g: torch.Tensor) -> torch.Tensor:
        """One step backward on (B, S): ``g @ T^T``."""
        out = torch.zeros_like(g)
        torch.mul(g[:, 1:], self._moves_on[:-1], out=out[:, :-1])
        return out.index_copy_(1, self._last, g.index_select(1, self._first) @ self.successor.T)

    def token_names(self) -> list[str]:
        from .language import SPECIAL_NAMES

        return list(SPECIAL_NAMES) + [f"c{i:02d}" for i in range(self.config.content_vocab)]

    def is_anchor_token(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(torch.as_tensor(rows), dtype=torch.bool)

    def anchor_value(self, n: int = 2000, seed: int = 20_000_000) -> dict[str, Estimate]:
        """No anchor symbols: what they are worth is 0 exactly (the anchored preset's figures, without its passes)."""
        zero = Estimate(0.0, 0.0, n)
        return {"mutual_information_per_token": zero, "gain_at_full_masking": zero, "anchors_per_row": zero}

    def words(self) -> list[str]:
        """The lexicon, most frequent first, each word as its symbols' names joined by ``+``."""
        names = self.token_names()
        return ["+".join(names[self.content_lo + v] for v in sp) for sp in self.spellings]

    # ------------------------------------------------------------------------------------------------ sampling

    def sample(self, n: int, seed: int) -> torch.LongTensor:
        if n < 0:
            raise TestbedError(f"n must be >= 0, got {n}")
        c = self.config
        rng = np.random.default_rng(np.random.SeedSequence([c.seed, 0x5A4, int(seed)]))
        L, V = c.length, c.content_vocab
        out = np.empty((n, L), dtype=np.int64)
        out[:, 0], out[:, -1] = BOS_ID, EOS_ID
        if n == 0:
            return torch.from_numpy(out)

        def draw(probs: np.ndarray) -> np.ndarray:
            u = rng.random(probs.shape[0])[:, None]
            return np.minimum((probs.cumsum(-1) < u).sum(-1), probs.shape[-1] - 1)

        succ, start = self.successor.numpy(), self.word_start.numpy()
        state = self.state_first[draw(np.broadcast_to(start, (n, start.size)))]
        for t in range(1, L - 1):
            if t > 1:
                nxt = self.state_next_in_word[state]
                new_word = self.state_first[draw(succ[self.state_word[state]])]
                state = np.where(nxt >= 0, nxt, new_word)
            typo = rng.random(n) < c.smoothing
            out[:, t] = self.content_lo + np.where(typo, rng.integers(0, V, n), self.state_symbol[state])
        return torch.from_numpy(out)

    # ------------------------------------------------------------------------------------------------ exact

    def _emission(self, z: torch.Tensor, masked: torch.Tensor) -> tuple[_Factors, torch.Tensor]:
        """The emission factors of the content positions (``_Factors``) and the log-factor of the framing (B,):
        0 when BOS/EOS are right or masked, -inf otherwise."""
        x, msk = z[:, 1:-1], masked[:, 1:-1]
        is_content = (x >= self.content_lo) & (x < self.anchor_lo) & ~msk
        v = (x - self.content_lo).clamp(0, self.config.content_vocab - 1)
        ok = (masked[:, 0] | (z[:, 0] == BOS_ID)) & (masked[:, -1] | (z[:, -1] == EOS_ID))
        return _Factors(self.E.T.contiguous(), v, is_content.double(), msk.double()), \
            torch.where(ok, 0.0, float("-inf")).double()

    def _forward(self, z: torch.Tensor, masked: torch.Tensor, keep: bool = False  # type: ignore[override]
                 ) -> tuple[torch.Tensor, list[torch.Tensor], _Factors]:
        """(log p(visible) (B,), the scaled filtered state distributions per content position when ``keep``,
        the emission factors)."""
        f, frame = self._emission(z, masked)
        logz = frame.clone()
        alphas: list[torch.Tensor] = []
        alpha = None
        for t in range(f.n):
            pred = self.pi.expand(z.shape[0], -1) if alpha is None else self._step(alpha)
            new = pred * f(t)
            s = new.sum(-1)
            logz = logz + torch.log(s)
            alpha = new / s.clamp_min(1e-300)[:, None]
            if keep:
                alphas.append(alpha)
        return logz, alphas, f

    def log_prob(self, rows: torch.Tensor) -> torch.Tensor:
        z = self._check(rows)
        return self._forward(z, torch.zeros_like(z, dtype=torch.bool))[0]

    def log_marginal(self, z: torch.Tensor, mask_id: int = MASK_ID) -> torch.Tensor:
        z = self._check(z)
        return self._forward(z, z == mask_id)[0]

    def conditionals(self, z: torch.Tensor, mask_id: int = MASK_ID, width: int | None = None,
                     strict: bool = False) -> torch.Tensor:
        z = self._check(z)
        width = width or self.vocab_size
        if width < self.vocab_size:
            raise TestbedError(f"width {width} is below the testbed's vocab_size {self.vocab_size}")
        if z.shape[0] > CHUNK:
            return torch.cat([self.conditionals(z[i:i + CHUNK], mask_id, width, strict)
                              for i in range(0, z.shape[0], CHUNK)])
        masked = z == mask_id
        logz, alphas, f = self._forward(z, masked, keep=True)
        bad = torch.isneginf(logz)
        if bad.any():
            if strict:
                raise TestbedError("the visible tokens of a row have probability 0 under the testbed: no conditional")
            z_msg = torch.where(bad[:, None], torch.full_like(z, mask_id), z)
            logz, alphas, f = self._forward(z_msg, z_msg == mask_id, keep=True)
        n = f.n
        # beta_t(s) = p(visible after t | state s at t), scaled per row; gamma_t = alpha_t beta_t.
        beta = torch.ones_like(alphas[0])
        post = [alphas[-1]]
        for t in range(n - 2, -1, -1):
            beta = self._step_back(beta * f(t + 1))
            beta = beta / beta.sum(-1, keepdim=True).clamp_min(1e-300)
            post.append(alphas[t] * beta)
        gamma = torch.stack(post[::-1], 1)  # (B, n, S), unnormalised p(state at t | visible)
        # At a masked position alpha_t carries no emission factor, so gamma_t E is p(x^t | visible); only the
        # masked positions need it (the visible ones are one-hot).
        mid = masked[:, 1:-1]
        scores = gamma[mid] @ self.E
        B = z.shape[0]
        logp_mid = torch.full((B, n, self.config.content_vocab), float("-inf"), dtype=torch.float64)
        logp_mid[mid] = torch.log(scores) - torch.log(scores.sum(-1, keepdim=True))
        out = torch.full((B, self.length, width), float("-inf"), dtype=torch.float64)
        out[:, 1:-1, self.content_lo:self.vocab_size] = logp_mid
        out[:, 0, BOS_ID] = 0.0
        out[:, -1, EOS_ID] = 0.0
        onehot = torch.full_like(out, float("-inf")).scatter_(-1, z[..., None].clamp(0, width - 1), 0.0)
        return torch.where((~masked)[..., None], onehot, out)

    def leave_one_out_conditionals(self, rows: torch.Tensor) -> torch.Tensor:
        """Exact ``log p(x^l | every other token)`` (B, L, vocab_size), float64, at every content position of fully
        visible rows, in one forward-backward pass (what ``conditionals`` gives with that one position masked):
        the prediction into position l times the backward message out of it."""
        z = self._check(rows)
        _, alphas, f = self._forward(z, torch.zeros_like(z, dtype=torch.bool), keep=True)
        n, B = f.n, z.shape[0]
        beta = torch.ones_like(alphas[0])
        betas = [beta]
        for t in range(n - 2, -1, -1):
            beta = self._step_back(beta * f(t + 1))
            beta = beta / beta.sum(-1, keepdim=True).clamp_min(1e-300)
            betas.append(beta)
        pred = torch.stack([self.pi.expand(B, -1)] + [self._step(a) for a in alphas[:-1]], 1)
        scores = (pred * torch.stack(betas[::-1], 1)) @ self.E  # (B, n, V)
        out = torch.full((B, self.length, self.vocab_size), float("-inf"), dtype=torch.float64)
        out[:, 0, BOS_ID] = 0.0
        out[:, -1, EOS_ID] = 0.0
        out[:, 1:-1, self.content_lo:] = torch.log(scores) - torch.log(scores.sum(-1, keepdim=True))
        return out

    def next_token_conditionals(self, rows: torch.Tensor) -> torch.Tensor:
        """Exact ``log p(x^l | x^{<l})`` (B, L, vocab_size), float64, at every content position (a causal LM's
        view; BOS and EOS positions one-hot): the forward algorithm's one-step predictions."""
        z = self._check(rows)
        f, _ = self._emission(z, torch.zeros_like(z, dtype=torch.bool))
        out = torch.full((z.shape[0], self.length, self.vocab_size), float("-inf"), dtype=torch.float64)
        out[:, 0, BOS_ID] = 0.0
        out[:, -1, EOS_ID] = 0.0
        alpha = None
        for t in range(f.n):
            pred = self.pi.expand(z.shape[0], -1) if alpha is None else self._step(alpha)
            out[:, t + 1, self.content_lo:] = torch.log(pred @ self.E)
            new = pred * f(t)
            alpha = new / new.sum(-1, keepdim=True).clamp_min(1e-300)
        return out


PRESET_CLASSES["natural"] = NaturalTestbed

__all__ = ["NaturalTestbed"]
