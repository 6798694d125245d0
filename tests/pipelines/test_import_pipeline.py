"""An imported released checkpoint is a version like a trained one: the MDLM reference fixture (its
Lightning .ckpt, tests/fixtures/reference/mdlm) is registered by ``pipelines.import_model`` with its provenance
tags, then goes through the staged evaluation (``evaluate --stage-all``, in process), ``generate`` with the
confidence sampler, ``mlflow models serve`` (a real scoring server over HTTP) and the lm-eval adapter. One real
sqlite registry, data prepared for the fixture's vocabulary (512 + the appended mask) and length (32), no Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.cluster import invocations, models_serve
from tests.support.eval import kjv_verses, pack_rows, tiny_gpt2, wiki_paragraphs, write_split

FIXTURE = Path(__file__).parents[1] / "fixtures" / "reference" / "mdlm" / "mdlm.ckpt"


def _data(root: Path):
    """A 512-entry byte-level BPE whose one special is GPT-2's <|endoftext|>, so the mask is appended at 512 as
    for GPT-2 (the fixture's embedding: 513 rows), and rows of 32 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from pipelines.data.tokenizer import load_tokenizer

    texts = kjv_verses(500) + wiki_paragraphs(40)
    data = root / "data"
    data.mkdir(parents=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok_path = data / "tokenizer.json"
    bpe.save(str(tok_path))
    tok = load_tokenizer(str(tok_path))
    assert tok.width == 513, "the fixture's embedding has 513 rows"
    write_split(data, "train", pack_rows(tok, texts[:400]), tok, tok_path)
    write_split(data, "validation", pack_rows(tok, texts[400:]), tok, tok_path)
    return data, tok, tok_path


@pytest.mark.slow
def test_an_imported_version_is_evaluated_staged_sampled_served_and_lm_evaluated(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], one_torch_thread) -> None:
    import mlflow
    from lm_eval.api.instance import Instance

    from pipelines.core.storage import sha256_file
    from pipelines.evaluation.config import EvalConfig
    from pipelines.evaluation.lm_eval_model import ADLMEvalLM
    from pipelines.evaluation.promotion import PromotionConfig, stage_all
    from pipelines.generate import main as generate
    from pipelines.serving.importing import import_model

    workdir = tmp_path / "work"
    tracking = f"sqlite:///{workdir / 'mlflow.db'}"
    workdir.mkdir()
    monkeypatch.setenv("ADLM_WORKDIR", str(workdir))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking)
    data, tok, tok_path = _data(tmp_path)

    res = import_model(str(FIXTURE), tokenizer=str(tok_path), workdir=str(workdir), tracking_uri=tracking)
    client = mlflow.MlflowClient(tracking)
    mv = client.get_model_version("adlm", res["version"])
    tags = mv.tags
    assert (res["kind"], res["family"], tags["kind"], tags["imported"]) == ("mdlm", "mdlm", "mdlm", "true")
    assert json.loads(tags["sha256"]) == {"mdlm.ckpt": sha256_file(FIXTURE), "tokenizer.json": sha256_file(tok_path)}
    assert tags["reference"] == "kuleshov-group/mdlm" and len(tags["reference_commit"]) == 40
    assert tags["source"] == str(FIXTURE) and tags["license"] == "apache-2.0"
    assert "candidate" in mv.aliases
    uri = res["uri"]
    again = import_model(str(FIXTURE), tokenizer=str(tok_path), workdir=str(workdir), tracking_uri=tracking)
    assert (again["version"], again["new"]) == (res["version"], False)  # the same files: nothing new registered

    # the staged evaluation decides it by the same rules as a trained version (a random model: its figures are
    # what they are; the gates are opened so that it runs every stage)
    ecfg = EvalConfig(eval_lm=str(tiny_gpt2(tmp_path)), mauve_featurizer="minilm", num_samples=4, sample_batch_size=4, mauve_min_samples=4,
                      steps=4, sampler="mdlm", max_rows=32, batch_size=16, data=str(data))
    promo = PromotionConfig(stage1_rows=16, stage1_max_ppl=1e9, stage1_tolerance=1e9, margin=0.0, gen_ppl_max=1e12,
                            entropy_min=0.0, mauve_min=0.0)
    [outcome] = stage_all(promo, ecfg, workdir=workdir, tracking_uri=tracking, in_process=True)
    assert outcome.version == res["version"] and outcome.status == "promoted", outcome
    assert outcome.figures and all(v == v for v in outcome.figures.values())
    assert str(client.get_model_version_by_alias("adlm", "champion").version) == res["version"]
    assert outcome.stage == 3 and {"val_ppl", "gen_ppl", "mauve"} <= set(outcome.figures), outcome.figures

    # generate with the confidence sampler
    assert generate(["--model", uri, "--sampler", "confidence", "--length", "8", "--steps", "4", "--seed", "0",
                     "--prompt", "In the beginning", "--json", "--tracking-uri", tracking]) == 0
    out = json.loads(capsys.readouterr().out)
    text = out["text"] if isinstance(out, dict) else out[0]["text"]
    assert text.startswith("In the beginning")

    # `mlflow models serve` answers with the imported weights over HTTP, and refuses a bad request in one line
    with models_serve(uri, tmp_path / "serve.log", tmp_path) as url:
        status, body = invocations(url, {"dataframe_records": [{"prompt": "And God said", "length": 6, "steps": 3,
                                                                "seed": 1}]})
        assert status == 200 and body["predictions"][0]["text"].startswith("And God said"), body
        status, body = invocations(url, {"dataframe_records": [{"prompt": "x", "length": 500}]})
        assert status == 400 and "exceeds the model's context of 32" in body["message"], body

    # the lm-eval adapter scores continuations with the imported weights
    lm = ADLMEvalLM(pretrained=uri, tracking_uri=tracking)
    pairs = [("In the beginning God created", " the heaven"), ("And God said, Let there", " be light")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True)
    assert len(got) == 2 and all(ll < 0 for ll, _ in got)
