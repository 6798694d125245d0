"""SSD-LM through the pipeline: the fixture (tests/fixtures/reference/ssdlm) imported as a registry version, sampled
with the reference's tokens, evaluated (entropy, gen-PPL, the arbitrary-length suite at toy size), served by its
MLflow model, and refused by ``train`` and the likelihood suites in one line. One real sqlite registry, no Ray."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.eval import tiny_gpt2

FIXTURE = Path(__file__).parents[1] / "fixtures" / "reference" / "ssdlm"
HUB = FIXTURE / "hub"


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from pipelines.serving.importing import import_model

    root = tmp_path_factory.mktemp("ssdlm")
    workdir = root / "work"
    workdir.mkdir()
    tracking = f"sqlite:///{workdir / 'mlflow.db'}"
    res = import_model(str(HUB), workdir=str(workdir), tracking_uri=tracking)
    return {"res": res, "root": root, "workdir": workdir, "tracking": tracking}


def test_the_released_layout_imports_as_a_sample_only_version(imported) -> None:
    import mlflow

    from pipelines.core.storage import sha256_file
    from pipelines.tracking.registry import resolve_model

    res, tracking = imported["res"], imported["tracking"]
    assert (res["kind"], res["family"], res["new"]) == ("ssdlm", "ssdlm", True)
    tags = mlflow.MlflowClient(tracking).get_model_version("adlm", res["version"]).tags
    assert (tags["kind"], tags["imported"], tags["family"], tags["reference"]) == ("ssdlm", "true", "ssdlm",
                                                                                 "xhan77/ssd-lm")
    assert tags["reference_commit"] == "c0b67612c27928350aa073b303bc9df3a0e87f28"
    # every file read, the tokenizer's among them
    assert json.loads(tags["sha256"]) == {f: sha256_file(HUB / f) for f in ("config.json", "model.safetensors",
                                                                           "embed_sum_layer.pt", "timestep_layer.pt",
                                                                           "vocab.json", "merges.txt")}
    ckpt = resolve_model(res["uri"], tracking, dst=imported["root"] / "dl")
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    assert tok["model"]["vocab"]["<mask>"] == 4 and tok["post_processor"]["type"] == "RobertaProcessing"


def test_the_hubs_pickled_files_give_the_same_weights_and_a_missing_tokenizer_is_named(imported, tmp_path) -> None:
    """xhan77/ssdlm holds pytorch_model.bin (every key, the tied decoder and the buffers too), read through the
    restricted unpickler; without vocab.json + merges.txt the import says what to pass, before any write."""
    from safetensors.torch import load_file

    from adlm_model.interop import reference_layouts as rl
    from pipelines.serving.importing import ImportInputError, import_model

    d = tmp_path / "bin"
    shutil.copytree(HUB, d)
    state = load_file(str(d / "model.safetensors"))
    state["lm_head.decoder.weight"] = state["roberta.embeddings.word_embeddings.weight"].clone()
    state["lm_head.decoder.bias"] = state["lm_head.bias"].clone()
    state["roberta.embeddings.position_ids"] = torch.arange(66)[None]
    (d / "model.safetensors").unlink()
    torch.save(state, d / "pytorch_model.bin")
    a = rl.convert(*(lambda s: (s, rl.detect_family(s)))(rl.read_source(d)), 320, 4)[0].state_dict()
    b = rl.convert(*(lambda s: (s, rl.detect_family(s)))(rl.read_source(HUB)), 320, 4)[0].state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    state["lm_head.decoder.weight"] = state["lm_head.decoder.weight"] + 1  # untied: not this network
    torch.save(state, d / "pytorch_model.bin")
    with pytest.raises(rl.ImportRefused, match="differs from the word embeddings"):
        rl.convert(*(lambda s: (s, rl.detect_family(s)))(rl.read_source(d)), 320, 4)

    bare = tmp_path / "bare"
    shutil.copytree(HUB, bare, ignore=shutil.ignore_patterns("vocab.json", "merges.txt"))
    with pytest.raises(ImportInputError, match=r"pass --tokenizer DIR holding its vocab.json and merges.txt") as e:
        import_model(str(bare), workdir=str(imported["workdir"]), tracking_uri=imported["tracking"])
    assert "\n" not in str(e.value)
    res = import_model(str(bare), tokenizer=str(HUB), workdir=str(imported["workdir"]),
                       tracking_uri=imported["tracking"])
    # the same weight files as the first import: that version, nothing new registered
    assert (res["kind"], res["version"], res["new"]) == ("ssdlm", imported["res"]["version"], False)


def test_generate_conditions_on_the_prompt_alone_as_the_reference(imported, capsys) -> None:
    """The references condition on the prompt alone, after a space they put before a prompt without one, and start
    from `<s>` only given no prompt (prompt_alone.json: the reference's decoder run on the fixture, its README says
    how). The CLI on the registered version gives the reference's tokens for "The city" at seed 2022 (B = 5,
    T = 25, K = 5, top-p 0.95), "The city" and " The city" condition alike, no prompt starts from `<s>`, and two
    blocks with the previous block as the context (the BD3-LM paper's runs) give the reference's ten tokens."""
    import torch

    from adlm_model.inference.infill import infill
    from adlm_model.inference.textgen import TextGenerator
    from pipelines.generate import main as generate
    from pipelines.tracking.registry import resolve_model

    fixture = json.loads((FIXTURE / "prompt_alone.json").read_text())
    s = fixture["settings"]
    ckpt = resolve_model(imported["res"]["uri"], imported["tracking"], dst=imported["root"] / "dl-gen")
    gen = TextGenerator.from_dir(ckpt, device="cpu")
    bos = gen.specials.bos_id
    for case in fixture["cases"]:
        length = s["block"] * case["blocks"]
        checked = gen.check(gen.request(prompt=case["prompt"], length=length, steps=s["steps"], block=s["block"],
                                        nucleus_p=s["top_p"], seed=case["seed"]))
        # what the sampler is given: the prompt's ids alone, or <s> alone for no prompt
        assert (checked.prompt_ids or [bos]) == case["context"] and checked.row == len(case["context"]) + length
        options = {"block_size": s["block"], **({"context": s["block"]} if case["blocks"] > 1 else {})}
        ids = infill(gen.model, gen.cfg, checked.prompt_ids, new_tokens=length, steps=s["steps"], sampler="ssdlm",
                     nucleus_p=s["top_p"], generator=torch.Generator().manual_seed(case["seed"]), bos_id=bos,
                     **options)
        assert ids[0].tolist() == case["tokens"], case

    first = fixture["cases"][0]
    assert first["prompt"] == "The city" and gen.check(gen.request(prompt="The city")).prompt_ids != gen._encode(
        "The city", "prompt")  # without the reference's space the prompt would be other tokens
    assert generate(["--model", imported["res"]["uri"], "--prompt", "The city", "--length", "5", "--block", "5",
                     "--steps", "25", "--nucleus-p", "0.95", "--seed", "2022", "--keep-going", "--json",
                     "--tracking-uri", imported["tracking"]]) == 0
    out = json.loads(capsys.readouterr().out)
    out = out[0] if isinstance(out, list) else out
    assert out["text"].startswith("The city") and out["sampler"] == "ssdlm" and out["network_calls"] == 25
    assert out["completion"] == gen.decode_between(first["context"], first["tokens"], [])

    checked = gen.check(gen.request(prompt="The city", length=12, steps=3, block=5, seed=0))
    calls, flops = gen.cost(checked)  # the served bound: T a block, each pass within the context
    assert calls == 9 and flops == 2.0 * gen.parameters * 9 * (len(checked.prompt_ids) + 12)
    calls, flops = gen.cost(gen.check(gen.request(prompt="The city", length=200, steps=3, seed=0)))
    assert calls == 3 * 8 and flops == 2.0 * gen.parameters * calls * 64  # 8 blocks of 25, passes of <= 64


def test_it_is_evaluated_and_served(imported, tmp_path, monkeypatch) -> None:
    import mlflow
    import pandas as pd

    from pipelines.evaluation.config import EvalConfig
    from pipelines.evaluation.run import evaluate_model

    uri, tracking = imported["res"]["uri"], imported["tracking"]
    lm = str(tiny_gpt2(tmp_path))
    cfg = EvalConfig(eval_lm=lm, num_samples=4, sample_batch_size=2, sample_length=12, steps=3,
                     sampler_kwargs={"block_size": 5}, long_length=80, long_num_samples=2, long_window=20,
                     long_min_entropy=1.0)
    r = evaluate_model(uri, ("generate", "gen_ppl", "arbitrary_length"), cfg, workdir=str(imported["workdir"]),
                       tracking_uri=tracking, in_process=True)
    m = r.metrics
    assert m["num_samples"] == 4 and 0 < m["entropy"] <= 2.5 and m["gen_ppl"] > 1
    assert all(len(s["ids"]) == 12 for s in r.samples)
    # 80 tokens beyond a context of 64: 16 blocks of 5 tokens, 3 steps each
    assert (m["long_samples"], m["long_length"], m["long_nfes"]) == (2, 80, 48)
    assert m["long_gen_ppl"] > 1 and m["long_gen_tokens"] > 64  # scored past the tiny LM's 64 positions
    assert 0 <= m["long_reached"] <= 1
    tags = mlflow.MlflowClient(tracking).get_model_version("adlm", imported["res"]["version"]).tags
    assert "sampler=ssdlm" in tags["long.settings"] and float(tags["long_nfes"]) == 48

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking)  # the served model loads from the registry
    model = mlflow.pyfunc.load_model(uri)
    out = model.predict(pd.DataFrame([{"prompt": " The city", "length": 7, "steps": 2, "seed": 3, "block": 5}]))
    row = out.iloc[0]
    assert row["text"].startswith(" The city") and row["sampler"] == "ssdlm" and row["network_calls"] == 4


def test_train_and_the_likelihood_suites_refuse_it_in_one_line(imported, capsys) -> None:
    from pipelines.evaluation.config import EvalConfig, EvalError
    from pipelines.evaluation.run import evaluate_model
    from pipelines.train import main as train

    assert train(["--config", "configs/demo.yaml", "--set", "model.kind=ssdlm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "training SSD-LM is out of scope" in err[0], err
    with pytest.raises(EvalError, match="scores the model's likelihood") as e:
        evaluate_model(imported["res"]["uri"], ("ppl",), EvalConfig(), workdir=str(imported["workdir"]),
                       tracking_uri=imported["tracking"], in_process=True)
    assert "\n" not in str(e.value)
    with pytest.raises(EvalError, match="sampler 'mdlm' does not run on a ssdlm model; it takes ssdlm") as e:
        evaluate_model(imported["res"]["uri"], ("arbitrary_length",), EvalConfig(sampler="mdlm", eval_lm="smollm2"),
                       workdir=str(imported["workdir"]), tracking_uri=imported["tracking"], in_process=True)
    assert "\n" not in str(e.value)


def test_the_tokenizer_is_part_of_an_imports_identity_and_aliases_are_checked_first(imported, tmp_path,
                                                                                   capsys) -> None:
    """The same weights with two ids swapped in vocab.json are another model: imported as a new version whose
    tokenizer has them swapped (they reused the old version and its tokenizer). Importing again with an alias sets
    it on the version already there; an alias the registry refuses is one line before anything is read, and the
    aliases stay as they were."""
    import mlflow

    from pipelines.import_model import main
    from pipelines.tracking.registry import resolve_model

    d = tmp_path / "swapped"
    shutil.copytree(HUB, d)
    vocab = json.loads((d / "vocab.json").read_text())
    a, b = sorted(t for t in vocab if vocab[t] >= 5)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (d / "vocab.json").write_text(json.dumps(vocab))
    flags = ["--workdir", str(imported["workdir"]), "--tracking-uri", imported["tracking"], "--json"]
    assert main([str(d), *flags]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["new"] and res["version"] != imported["res"]["version"]
    tok = json.loads((resolve_model(res["uri"], imported["tracking"], dst=tmp_path / "dl") / "tokenizer.json")
                     .read_text())
    assert (tok["model"]["vocab"][a], tok["model"]["vocab"][b]) == (vocab[a], vocab[b])

    client = mlflow.MlflowClient(imported["tracking"])
    before = dict(client.get_registered_model("adlm").aliases)
    assert main([str(d), "--alias", "not an alias", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --alias: Invalid alias name"), err
    assert main([str(d), "--alias", "swapped-vocab", *flags]) == 0
    again = json.loads(capsys.readouterr().out)
    assert (again["version"], again["new"]) == (res["version"], False)
    assert dict(client.get_registered_model("adlm").aliases) == {**before, "swapped-vocab": int(res["version"])}
