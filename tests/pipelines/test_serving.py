"""Calling a model: registered versions are MLflow Models (pyfunc, models-from-code), ``pipelines.generate``
with infilling, ``mlflow models serve`` over HTTP, and the Hugging Face-style export.

Everything here is real: tiny models trained for a few steps on the bundled corpora, a 384-entry byte-level
BPE, a sqlite registry, the evaluation suite tagging a version, and (slow) a ``mlflow models serve`` process.

Longer than 500 lines because every test here shares one module-scoped fixture (``art``: the tiny models of every
kind, trained and registered once); split across modules, each module would train them again (xdist runs whole
modules per worker).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import shutil
import sys

import pytest
import torch

from adlm_model import GenerationError, TextGenerator, infill, load_checkpoint, load_pretrained, sample
from adlm_model.inference.textgen import GenerationRequest
from adlm_model.sampling.samplers import SamplerError
from tests.support.cluster import http_ok, invocations, models_serve, stop_group
from tests.support.eval import make_data, register, save_ckpt, tiny_config, train_tiny

PROMPT, SUFFIX = "In the beginning God", " and the earth."


@pytest.fixture(scope="module")
def art(tmp_path_factory, one_torch_thread):
    """Data, a tiny trained checkpoint of every kind, and a sqlite registry whose version 1 (MDLM, alias
    candidate) has been evaluated (validation bound, samples, gen-PPL under the tiny AR model)."""
    from pipelines.data.reader import read_rows
    from pipelines.evaluation.config import EvalConfig
    from pipelines.evaluation.run import evaluate_model

    root = tmp_path_factory.mktemp("serving")
    data, tok, tok_path = make_data(root)
    rows, _ = read_rows(str(data / "train"))
    out = {"root": root, "data": data, "tok": tok}
    for kind, steps in (("mdlm", 40), ("adlm", 20), ("ar", 40), ("bd3lm", 20), ("a2r", 20)):
        cfg = tiny_config(tok, kind)
        model, ema = train_tiny(cfg, rows, steps)
        out[kind] = save_ckpt(root / f"ck-{kind}", model, cfg, ema, tok_path, data, step=steps)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ADLM_WORKDIR", str(root / "work"))
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mv = register(out["mdlm"], uri, kind="mdlm")
        cfg = EvalConfig(max_rows=32, num_samples=4, sample_batch_size=4, steps=8, eval_lm=str(out["ar"]))
        evaluate_model("models:/adlm/1", "ppl,gen_ppl", cfg, workdir=root / "work", tracking_uri=uri,
                       in_process=True)
    out.update(uri=uri, version=str(mv.version), run_id=mv.run_id)
    return out


@pytest.fixture()
def registry(art, monkeypatch: pytest.MonkeyPatch):
    """The registry of ``art`` as the process's tracking store (what a user's shell would set)."""
    monkeypatch.setenv("ADLM_WORKDIR", str(art["root"] / "work"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", art["uri"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # pyfunc.load_model prepends the model's code folder
    return art


def _generator(art, kind: str) -> TextGenerator:
    from pipelines.serving.generate import open_generator

    return open_generator(str(art[kind])).generator


# --------------------------------------------------------------------------------------------------------
# Token level and text level


@pytest.mark.parametrize("kind", ["mdlm", "adlm", "bd3lm"])
def test_infill_keeps_the_given_tokens_and_reads_the_suffix(art, kind) -> None:
    model, cfg, _ = load_checkpoint(art[kind])
    prompt, suffix = [5, 6, 7], [8, 9]

    def g() -> torch.Generator:  # the same draws for every call
        return torch.Generator().manual_seed(11)

    new = infill(model, cfg, prompt, suffix, new_tokens=12, steps=8, generator=g(), num_samples=2,
                 bos_id=art["tok"].bos_id)
    assert new.shape == (2, 12) and not (new == cfg.mask_id).any()
    # The same row through sample(): the given positions come back unchanged and the middle is infill's.
    tokens = torch.tensor([[art["tok"].bos_id, *prompt, *[cfg.mask_id] * 12, *suffix]])
    keep = tokens != cfg.mask_id
    full = sample(model, cfg, batch_size=2, length=tokens.shape[1], steps=8,
                  sampler="bd3lm" if kind == "bd3lm" else "remdm-loop", generator=g(), prefix=(tokens, keep))
    assert torch.equal(full[:, keep[0]], tokens[:, keep[0]].expand(2, -1)) and torch.equal(full[:, 4:16], new)
    # The network reads the suffix: from the first step on for the diffusion samplers (both sides seen),
    # when the last block is denoised for the block sampler.
    embed = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding))
    seen: list[torch.Tensor] = []
    handle = embed.register_forward_pre_hook(lambda mod, args: seen.append(args[0].clone()))
    try:
        infill(model, cfg, prompt, suffix, new_tokens=12, steps=8, generator=g(), num_samples=2,
               bos_id=art["tok"].bos_id)
    finally:
        handle.remove()
    if kind == "bd3lm":
        assert any(x.shape[1] == cfg.block_size and x[0, :2].tolist() == suffix for x in seen)
    else:
        assert torch.equal(seen[0], tokens.expand(2, -1))


def test_block_sampler_generates_beyond_the_training_length(art) -> None:
    gen = _generator(art, "bd3lm")
    n = gen.cfg.seq_len + 13
    out = gen.generate(gen.request(prompt=PROMPT, suffix=SUFFIX, length=n, steps=4, seed=1))[0]
    assert out.new_tokens == n and out.text.startswith(PROMPT) and out.text.endswith(SUFFIX)
    with pytest.raises(GenerationError, match="exceeds the model's context of 32 .* bd3lm sampler generates any"):
        gen.check(gen.request(prompt=PROMPT, length=n, sampler="mdlm"))


@pytest.mark.parametrize("kind", ["mdlm", "adlm", "ar", "bd3lm", "a2r"])
def test_text_starts_with_the_prompt_and_ends_with_the_suffix(art, kind) -> None:
    gen = _generator(art, kind)
    suffix = "" if kind in ("ar", "a2r") else SUFFIX  # a causal model continues a prompt only
    req = gen.request(prompt=PROMPT, suffix=suffix, length=10, steps=8, seed=5, num_samples=2)
    outs = gen.generate(req)
    assert len(outs) == 2
    for o in outs:
        assert o.text.startswith(PROMPT) and o.text.endswith(suffix) and o.new_tokens == 10 and o.seconds > 0
        assert o.text == PROMPT + o.completion + suffix and o.seed == 5
        assert o.sampler == {"ar": "ar", "a2r": "ar", "bd3lm": "bd3lm"}.get(kind, "remdm-loop")
    # The same seed gives the same texts; the batch is one generator, so its two samples differ.
    assert [o.text for o in gen.generate(req)] == [o.text for o in outs]
    assert outs[0].text != outs[1].text


@pytest.mark.parametrize(("kind", "fields", "message"), [
    ("mdlm", {"steps": -3}, "steps must be >= 1, got -3"),
    ("mdlm", {"sampler": "greedy"}, "unknown sampler 'greedy'"),
    ("mdlm", {"length": 40}, "exceeds the model's context of 32 for sampler 'remdm-loop': ask for length <= "),
    ("mdlm", {"sampler": "ar"}, "sampler 'ar' does not run on a mdlm model"),
    ("mdlm", {"length": 2.5}, "length must be an integer, got 2.5"),
    ("mdlm", {"nucleus_p": "high"}, "nucleus_p must be a number"),
    ("mdlm", {"nucleus_p": 0.0}, "nucleus_p must be in"),
    ("mdlm", {"seed": -1}, "seed must lie in"),
    ("mdlm", {"prompt": "a <|mask|> b"}, "the prompt contains the mask token '<|mask|>'"),
    ("mdlm", {"temperature": 1.0}, "unknown field"),
    ("mdlm", {"threshold": 0.9}, "threshold is a setting of the confidence sampler, not of 'remdm-loop'"),
    ("mdlm", {"sampler": "confidence", "threshold": 1.5}, "threshold must be a number in [0, 1], got 1.5"),
    ("adlm", {"sampler": "confidence", "block": 3}, "block 3 does not divide the length 8"),
    ("adlm", {"sampler": "confidence", "refresh": 0}, "refresh must be >= 1"),
    ("mdlm", {"sampler": "confidence", "kv_cache": "all"}, "kv_cache must be one of off, prefix, dual"),
    ("mdlm", {"stop_at_eos": "yes"}, "stop_at_eos must be true or false"),
    ("ar", {"suffix": " the end"}, "cannot infill: drop the suffix"),
    # a sampler of another kind: the line names the samplers the model takes
    ("adlm", {"sampler": "bd3lm"}, "sampler 'bd3lm' does not run on a adlm model; it takes remdm-loop, mdlm, "
                                   "confidence (default 'remdm-loop')"),
    ("mdlm", {"sampler": "sedd-euler"}, "'sedd-euler' does not run on a mdlm model; it takes remdm-loop, mdlm, "
                                        "confidence, bd3lm"),
    ("bd3lm", {"sampler": "sedd-analytic"}, "it takes bd3lm, mdlm, remdm-loop, confidence (default 'bd3lm')"),
    ("ar", {"sampler": "sedd-analytic"}, "'sedd-analytic' does not run on a ar model; it takes ar, ar-window (default 'ar')"),
])
def test_bad_requests_fail_in_one_line_before_the_network_runs(art, kind, fields, message) -> None:
    gen = _generator(art, kind)
    calls = []
    handle = gen.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(GenerationError) as e:
            gen.generate(gen.request(**{"prompt": "In the", "length": 8, **fields}))
    finally:
        handle.remove()
    assert message in str(e.value) and "\n" not in str(e.value) and not calls


@pytest.mark.parametrize("kind", ["mdlm", "adlm"])
def test_confidence_settings_reach_the_sampler_and_come_back_with_the_text(art, kind) -> None:
    gen = _generator(art, kind)
    req = gen.request(prompt=PROMPT, suffix=SUFFIX, length=8, sampler="confidence", threshold=1.0, block=4,
                      refresh=1, seed=3)
    out = gen.generate(req)[0]
    # No T in the settings: the confidence sampler runs until every position is decided, and says how long.
    assert out.settings == {"sampler": "confidence", "nucleus_p": req.nucleus_p, "length": 8,
                            "seed": 3, "stop_at_eos": True, "threshold": 1.0, "block": 4, "refresh": 1,
                            "kv_cache": "dual"}
    assert out.network_calls == out.steps == 8  # threshold 1: one token a step; refresh 1: the uncached text
    exact = gen.generate(dataclasses.replace(req, refresh=None))[0]
    assert exact.text == out.text and exact.settings["kv_cache"] == "off"
    assert gen.generate(gen.request(prompt=PROMPT, length=8, sampler="confidence", threshold=0.0,
                                    seed=3))[0].network_calls == 1


@pytest.mark.parametrize("kind", ["mdlm", "ar", "bd3lm", "a2r"])
def test_steps_and_network_calls_are_what_the_sampler_ran(art, kind) -> None:
    """Counted forward passes, not a setting echoed: AR one per new token (its KV cache: the prompt's pass gives
    the first), the diffusion samplers at most T + 1 (a row that did not change reuses its p_x0), bd3lm per
    block; ``steps`` is T where a sampler takes it and the iterations it ran where it does not (ar)."""
    gen = _generator(art, kind)
    calls = []
    handle = gen.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        out = gen.generate(gen.request(prompt="In the", length=6, steps=5, seed=2))[0]
    finally:
        handle.remove()
    if kind in ("ar", "a2r"):  # the network (A2R: both, in one call) is the model itself: its calls are seen here
        assert out.network_calls == len(calls) == out.steps == 6 and "steps" not in out.settings
    else:
        assert out.steps == 5 and out.settings["steps"] == 5
        assert 1 <= out.network_calls <= (5 + 1) * (1 if kind == "mdlm" else 6), out


def test_text_stops_at_the_first_eos_and_shows_no_special_token(art) -> None:
    gen, tok = _generator(art, "mdlm"), art["tok"]
    words = gen.tokenizer.encode(" the earth", add_special_tokens=False).ids
    more = gen.tokenizer.encode(" and God", add_special_tokens=False).ids
    row = [*words, tok.eos_id, *more, tok.bos_id, tok.mask_id]
    assert gen.decode_between([], gen.until_eos(row), []) == " the earth"  # keeps going; EOS, BOS, mask not shown:
    assert gen.decode_between([], gen.until_eos(row, stop=False), []) == " the earth and God"
    specials = [gen.tokenizer.id_to_token(i) for i in (tok.eos_id, tok.bos_id, tok.mask_id) if i is not None]
    for stop in (True, False):
        for o in gen.generate(gen.request(prompt=PROMPT, length=20, steps=8, seed=9, num_samples=4,
                                          stop_at_eos=stop)):
            assert o.text.startswith(PROMPT) and not any(s in o.completion for s in specials)


def test_infill_rejects_a_suffix_for_ar_at_the_token_level(art) -> None:
    model, cfg, _ = load_checkpoint(art["ar"])
    with pytest.raises(SamplerError, match="cannot infill"):
        infill(model, cfg, [5], [6], new_tokens=4, steps=1, generator=torch.Generator(), bos_id=0)


# --------------------------------------------------------------------------------------------------------
# Registered versions are MLflow Models


def test_a_registered_version_is_an_mlflow_model(registry) -> None:
    import mlflow
    import yaml

    from pipelines.tracking.mlflow_model import pip_requirements
    from pipelines.tracking.registry import download_version, get_version, resolve_model

    mv = get_version("models:/adlm@candidate", registry["uri"])
    assert mv.run_id == registry["run_id"] and mv.tags["kind"] == "mdlm" and "checkpoint_uri" in mv.tags
    assert mv.tags["val_ppl"] and mv.tags["gen_ppl"] and mv.tags["entropy"]  # the evaluation tagged it as before
    root = download_version("models:/adlm@candidate", registry["uri"], dst=registry["root"] / "dl")
    spec = yaml.safe_load((root / "MLmodel").read_text())
    pyfunc = spec["flavors"]["python_function"]
    assert pyfunc["loader_module"] == "mlflow.pyfunc.loaders.code_model"  # models-from-code, not a pickle
    assert not list(root.rglob("*.pkl")) and not list(root.rglob("*.pickle"))
    assert (root / "code" / "adlm_model" / "inference" / "textgen.py").is_file() and not (root / "code" / "pipelines").exists()
    # Nothing in a version names a module of ``pipelines`` (its code is a file copied in, its checkpoint safetensors
    # and JSON): moving the package's modules cannot break a version registered before the move.
    for f in [p for p in root.rglob("*") if p.is_file() and p.suffix in ("", ".json", ".yaml", ".txt", ".py")]:
        text = f.read_text(errors="replace")
        if f.suffix == ".py":
            imported = [n.module or "" for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ImportFrom)]
            imported += [a.name for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Import) for a in n.names]
            assert not [m for m in imported if m.split(".")[0] == "pipelines"], f
        else:
            assert not re.search(r"\bpipelines\.\w", text), f
    # No enforced input schema (MLflow's drops unknown columns silently); the typed request fields are metadata.
    assert not spec["signature"].get("inputs")
    fields = spec["metadata"]["request_fields"]
    assert fields["length"] == fields["steps"] == fields["seed"] == fields["block"] == "integer"
    assert set(fields) == {"prompt", "suffix", "length", "steps", "sampler", "nucleus_p", "seed", "threshold", "block",
                           "refresh", "kv_cache", "stop_at_eos"}
    assert {c["name"] for c in json.loads(spec["signature"]["outputs"])} >= {"text", "new_tokens", "seconds"}
    reqs = (root / "requirements.txt").read_text().split()
    assert set(pip_requirements()) <= set(reqs) and any(r.startswith("torch==") for r in reqs)
    assert not any(r.startswith(("ray", "adlm")) for r in reqs)
    # The model links back to the training run; evaluation still finds the checkpoint inside it.
    assert mv.source.startswith("models:/m-")  # the version's source is the logged model
    logged = mlflow.MlflowClient(registry["uri"]).get_logged_model(mv.source.removeprefix("models:/"))
    assert logged.source_run_id == mv.run_id and logged.status == "READY"
    ckpt = resolve_model("models:/adlm@candidate", registry["uri"], dst=registry["root"] / "dl2")
    model, cfg, _ = load_checkpoint(ckpt)
    want, _, _ = load_checkpoint(registry["mdlm"])
    assert cfg.kind == "mdlm" and all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                                        want.state_dict().values(), strict=True))


def test_registering_leaves_the_process_tracking_settings_alone(registry) -> None:
    import mlflow

    before = (os.environ["MLFLOW_TRACKING_URI"], mlflow.get_tracking_uri())
    mv = register(registry["mdlm"], registry["uri"], name="adlm-env", kind="mdlm")
    assert str(mv.version) == "1" and (os.environ.get("MLFLOW_TRACKING_URI"), mlflow.get_tracking_uri()) == before


def test_a_checkpoint_missing_a_file_registers_nothing(registry, tmp_path) -> None:
    import shutil

    from pipelines.tracking.registry import RegistryError
    from pipelines.tracking.runs import client

    broken = tmp_path / "broken"
    shutil.copytree(registry["mdlm"], broken)
    (broken / "model.safetensors").unlink()
    before = len(client(registry["uri"]).search_model_versions("name='adlm'"))
    with pytest.raises(RegistryError, match="lacks model.safetensors"):
        register(broken, registry["uri"], kind="mdlm")
    assert len(client(registry["uri"]).search_model_versions("name='adlm'")) == before


def test_an_old_bare_folder_version_still_resolves(registry) -> None:
    from pipelines.tracking.registry import resolve_model
    from pipelines.tracking.runs import client

    c = client(registry["uri"])
    source = c.get_run(registry["run_id"]).info.artifact_uri + "/checkpoint"  # how versions were registered before
    c.create_registered_model("adlm-bare")
    mv = c.create_model_version("adlm-bare", source=source, run_id=registry["run_id"])
    local = resolve_model(f"models:/adlm-bare/{mv.version}", registry["uri"], dst=registry["root"] / "bare")
    assert (local / "config.json").is_file() and load_checkpoint(local)[1].kind == "mdlm"


def test_pyfunc_predict_equals_pipelines_generate(registry, capsys, monkeypatch) -> None:
    import mlflow
    import pandas as pd

    from pipelines.generate import main as generate

    model = mlflow.pyfunc.load_model("models:/adlm@candidate")
    rows = [{"prompt": PROMPT, "suffix": SUFFIX, "length": 9, "steps": 8, "seed": 21},
            {"prompt": "And God said", "length": 6, "seed": 3, "sampler": "mdlm", "nucleus_p": 1}]
    batch = model.predict(pd.DataFrame(rows))
    assert list(batch["seed"]) == [21, 3] and len(batch) == 2
    assert batch["text"][0].startswith(PROMPT) and batch["text"][0].endswith(SUFFIX)
    # Each row is independent of the batch it came in.
    for i, row in enumerate(rows):
        alone = model.predict(pd.DataFrame([row]))
        assert alone["text"][0] == batch["text"][i]
    # The CLI, same settings, same seed: the same text.
    capsys.readouterr()
    rc = generate(["--model", "models:/adlm@candidate", "--prompt", PROMPT, "--suffix", SUFFIX, "--length", "9",
                   "--steps", "8", "--seed", "21", "--json", "--quiet"])
    cli = json.loads(capsys.readouterr().out)
    assert rc == 0 and [c["text"] for c in cli] == [batch["text"][0]] and cli[0]["seed"] == 21
    # A bad row: the whole request fails before generating, with INVALID_PARAMETER_VALUE (HTTP 400 when served).
    with pytest.raises(mlflow.exceptions.MlflowException) as e:
        model.predict(pd.DataFrame([rows[0], {"prompt": "x", "steps": -1}]))
    assert e.value.error_code == "INVALID_PARAMETER_VALUE" and "request row 1: steps must be >= 1" in e.value.message
    # The settings used come back with every row; a misspelt field is refused with the known ones listed.
    assert json.loads(batch["settings"][1])["sampler"] == "mdlm" and json.loads(batch["settings"][0])["steps"] == 8
    fast = model.predict(pd.DataFrame([{"prompt": PROMPT, "length": 8, "sampler": "confidence", "threshold": 0.5,
                                        "block": 4, "refresh": 2, "seed": 1}]))
    assert json.loads(fast["settings"][0]) == {"sampler": "confidence", "nucleus_p": 0.9, "length": 8,
                                               "seed": 1, "stop_at_eos": True, "threshold": 0.5, "block": 4,
                                               "refresh": 2, "kv_cache": "dual"}
    assert 2 <= fast["steps"][0] == fast["network_calls"][0] <= 8  # the passes it made, not the default T of 128
    for bad, reason in (({"prompt": "x", "lenght": 8}, "unknown field(s) lenght; known: prompt, suffix, length"),
                        ({"prompt": "x", "num_samples": 3}, "unknown field(s) num_samples"),
                        ({"prompt": "x", "length": 8, "steps": 100_000_000}, "steps 100000000 exceeds the limit max_steps=4096"),
                        ({"prompt": "x", "steps": 4000, "length": 30}, "exceeds the limit max_work=1e+09 (ADLM_MAX_WORK)")):
        monkeypatch.setenv("ADLM_MAX_WORK", "1e9")  # the served model's setting, read at each request
        with pytest.raises(mlflow.exceptions.MlflowException) as e:
            model.predict(pd.DataFrame([bad]))
        assert e.value.error_code == "INVALID_PARAMETER_VALUE" and reason in e.value.message, e.value.message
    with pytest.raises(mlflow.exceptions.MlflowException, match="17 rows exceed the limit max_rows=16"):
        model.predict(pd.DataFrame([{"prompt": "x", "length": 8}] * 17))

    # Through the scoring server's own request handling (what `mlflow models serve` runs for /invocations): a
    # refusal is the one line, without the request echoed ("Failed to predict data '<DataFrame>'. Error: ...").
    from mlflow.pyfunc.scoring_server import invocations

    monkeypatch.delenv("ADLM_MAX_WORK")

    def served(payload: dict) -> dict:
        try:
            r = invocations(json.dumps(payload), "application/json", model, model.metadata.get_input_schema())
        except mlflow.exceptions.MlflowException as e:
            return {"status": e.get_http_status_code(), **json.loads(e.serialize_as_json())}
        return {"status": r.status, **json.loads(r.response)}

    long_prompt = "And God said " * 30
    for payload, line in (
        ({"dataframe_records": [{"prompt": "x", "steps": -2, "length": 8}]}, "request row 0: steps must be >= 1, got -2"),
        ({"dataframe_records": [{}]}, 'request row 0: prompt is required ("" for text from nothing)'),
        ({"inputs": [{"length": 4}]}, 'request row 0: prompt is required ("" for text from nothing)'),
        ({"dataframe_records": [{"prompt": long_prompt, "length": 4}]},
         "leave no room for new ones: shorten them (together at most 30 tokens for length 1)"),
        ({"inputs": {"prompt": ["a", "b"], "length": [4, 5, 6]}}, "columns of different lengths (2, 3 values)"),
        ({"inputs": [3, 4]}, "requests must be records"),
    ):
        got = served(payload)
        assert got["status"] == 400 and got["error_code"] == "INVALID_PARAMETER_VALUE", got
        assert line in got["message"] and "\n" not in got["message"] and "Failed to predict" not in got["message"]
        assert got["message"].startswith(("request row 0: ", "columns", "requests")), got
    # The `inputs` format: records, columns with one value for all, a list of prompts; the same text as the
    # DataFrame for the same seed.
    want = model.predict(pd.DataFrame([{"prompt": PROMPT, "length": 4, "steps": 4, "seed": 5}]))["text"][0]
    for payload in ({"inputs": [{"prompt": PROMPT, "length": 4, "steps": 4, "seed": 5}]},
                    {"inputs": {"prompt": [PROMPT], "length": 4, "steps": 4, "seed": 5}},
                    {"inputs": {"prompt": PROMPT, "length": 4, "steps": 4, "seed": 5}}):
        got = served(payload)
        assert got["status"] == 200 and [p["text"] for p in got["predictions"]] == [want], (payload, got)
    got = served({"inputs": ["In the", "And God"]})
    assert got["status"] == 400 and "request row 0: BOS + prompt + length + suffix" in got["message"]  # length 64


def test_the_served_model_loads_its_weights_on_the_first_request_and_keeps_them(registry, monkeypatch,
                                                                               tmp_path) -> None:
    import mlflow
    import pandas as pd

    from adlm_model.inference.textgen import TextGenerator

    loads: list[str] = []
    original = TextGenerator.from_dir.__func__

    def counting(cls, directory, *args, **kwargs):
        loads.append(str(directory))
        return original(cls, directory, *args, **kwargs)

    monkeypatch.setattr(TextGenerator, "from_dir", classmethod(counting))
    # A copy of its own (a local store serves its artifact folder itself, which other tests have loaded).
    local = mlflow.artifacts.download_artifacts("models:/adlm@candidate", dst_path=str(tmp_path))
    model = mlflow.pyfunc.load_model(local)
    assert loads == []  # loading the MLflow Model reads no weights
    row = pd.DataFrame([{"prompt": PROMPT, "length": 4, "steps": 4, "seed": 1}])
    first = model.predict(row)
    assert len(loads) == 1
    again = model.predict(row)
    assert len(loads) == 1 and again["text"][0] == first["text"][0]  # the weights stay loaded


def test_generate_cli_shows_a_progress_bar_over_steps(registry, capsys) -> None:
    from pipelines.generate import main as generate

    assert generate(["--model", "models:/adlm@candidate", "--prompt", PROMPT, "--length", "4", "--steps", "6",
                     "--seed", "2"]) == 0
    out = capsys.readouterr()
    # tqdm on stderr (stdout keeps the text alone): the bar over the sampler's steps, 6 + the final greedy fill
    assert "sampling:" in out.err and "/7 [" in out.err and out.out.strip().startswith(PROMPT)
    assert generate(["--model", "models:/adlm@candidate", "--prompt", PROMPT, "--length", "4", "--steps", "6",
                     "--seed", "2", "--quiet"]) == 0
    assert "sampling" not in capsys.readouterr().err


def test_generate_cli_help_and_bad_input_exit_codes(registry, capsys, monkeypatch) -> None:
    from pipelines.generate import main as generate

    with pytest.raises(SystemExit) as e:
        generate(["--help"])
    assert e.value.code == 0 and "--suffix" in capsys.readouterr().out
    assert generate(["--model", "models:/adlm@candidate", "--prompt", "x", "--steps", "0", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: steps must be >= 1, got 0"]
    assert generate(["--model", "models:/adlm@nosuch", "--prompt", "x", "--quiet"]) == 2
    assert "has no alias 'nosuch'" in capsys.readouterr().err
    assert generate(["--model", str(registry["ar"]), "--prompt", "x", "--suffix", "y", "--quiet"]) == 2
    assert "cannot infill" in capsys.readouterr().err
    for model, sampler in ((registry["adlm"], "bd3lm"), (registry["adlm"], "sedd-euler"), ("models:/adlm@candidate",
                                                                                            "sedd-analytic")):
        assert generate(["--model", str(model), "--prompt", "x", "--sampler", sampler, "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"error: sampler {sampler!r} does not run on a " in err[0] and "it takes " in err[0]
    # The served model's limits hold here too (a run of 10^8 steps would take most of an hour), unless lifted.
    assert generate(["--model", "models:/adlm@candidate", "--prompt", "x", "--length", "8", "--steps", "100000000",
                     "--quiet"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: steps 100000000 exceeds the limit max_steps=4096 (ADLM_MAX_STEPS): ask for fewer steps (or raise "
        "the setting, or pass --no-limits)"]
    monkeypatch.setenv("ADLM_MAX_STEPS", "4")
    args = ["--model", "models:/adlm@candidate", "--prompt", "x", "--length", "4", "--steps", "6", "--quiet"]
    assert generate(args) == 2 and "max_steps=4 (ADLM_MAX_STEPS)" in capsys.readouterr().err
    assert generate([*args, "--no-limits"]) == 0


# --------------------------------------------------------------------------------------------------------
# Export


def test_export_reloads_bit_for_bit_and_its_card_lists_the_registry_figures(registry, tmp_path, capsys) -> None:
    from adlm_model.interop.pretrained import HF_CODE, PRETRAINED_FILES
    from pipelines.evaluation.suites import figures as described
    from pipelines.export import main as export
    from pipelines.serving.export import figures_of
    from pipelines.tracking.registry import get_version, resolve_model

    out = tmp_path / "exported"
    assert export(["models:/adlm@candidate", "--out", str(out), "--json"]) == 0
    written = json.loads(capsys.readouterr().out)
    assert {p.name for p in out.iterdir()} == {"README.md", *PRETRAINED_FILES, *HF_CODE}
    assert not list(tmp_path.glob(".exported-*"))  # the staging folder is gone

    # The same logits as the registered version's EMA weights, bit for bit (transformers' load: test_hf_export).
    served, cfg, _ = load_checkpoint(resolve_model("models:/adlm@candidate", registry["uri"], dst=tmp_path / "dl"))
    back, cfg2, meta = load_pretrained(out)
    assert cfg2 == cfg and meta["registered_model"] == "adlm" and meta["version"] == registry["version"]
    z, sigma = torch.randint(0, cfg.width, (3, cfg.seq_len), generator=torch.Generator().manual_seed(0)), torch.zeros(3)
    with torch.no_grad():
        assert torch.equal(served.denoiser_logits(z, sigma), back.eval().denoiser_logits(z, sigma))
    # And the same text for the same request.
    req = GenerationRequest(prompt=PROMPT, suffix=SUFFIX, length=8, steps=8, seed=4)
    assert TextGenerator.from_dir(out).generate(req)[0].text == _generator(registry, "mdlm").generate(req)[0].text

    # The card lists every figure the version's tags hold, with its settings and its definition.
    tags = get_version("models:/adlm@candidate", registry["uri"]).tags
    figures = figures_of(tags)
    assert {"val_ppl", "gen_ppl", "entropy"} <= set(figures) and written["figures"] == figures
    card = (out / "README.md").read_text()
    for k, v in figures.items():
        assert f"(`{k}`) | {'<= ' if k == 'val_ppl' else ''}{v} |" in card
    for setting in ("val_ppl.settings", "gen.settings", "gen_ppl.eval_lm"):
        assert tags[setting] in card
    definitions = {f.tag: f.definition for f in described()}
    for k in ("gen_ppl", "entropy"):
        assert definitions[k] in card
    assert "one `t` per sequence" in card and f"| parameters | {written['parameters']:,} |" in card
    assert "AutoModelForMaskedLM.from_pretrained('.', trust_remote_code=True)" in card  # the transformers lines

    # A folder in use is refused in one line; --force replaces an earlier export only.
    assert export(["models:/adlm@candidate", "--out", str(out)]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert export(["models:/adlm@candidate", "--out", str(tmp_path)]) == 2
    assert "not an empty folder or an earlier export" in capsys.readouterr().err
    assert export(["models:/adlm@candidate", "--out", str(out), "--force"]) == 0


def test_a_version_whose_files_were_deleted_is_one_line_in_every_command(registry, tmp_path, capsys,
                                                                         monkeypatch) -> None:
    """The registry keeps a version whose artifacts were deleted: generate, export, serve and evaluate said
    ``No such artifact`` in a traceback; each names the version and what to do, in one line, exit 2."""
    import mlflow

    from pipelines.evaluate import main as evaluate
    from pipelines.export import main as export
    from pipelines.generate import main as generate
    from pipelines.serve import main as serve
    from pipelines.tracking.registry import register_checkpoint
    from pipelines.tracking.runs import ensure_experiment

    monkeypatch.setenv("PATH", os.environ["PATH"])  # serve puts the venv first on it
    uri = registry["uri"]
    client = mlflow.MlflowClient(uri)
    run = client.create_run(ensure_experiment("adlm", uri), run_name="gone")
    client.log_artifacts(run.info.run_id, str(registry["mdlm"]), "checkpoint")
    mv = register_checkpoint(run.info.run_id, "gone", {"kind": "mdlm"}, tracking_uri=uri, aliases=())
    for location in (client.get_run(run.info.run_id).info.artifact_uri, client.get_model_version_download_uri(
            "gone", mv.version)):  # the run's files and the logged model's
        shutil.rmtree(location.removeprefix("file://"))
    capsys.readouterr()
    model = f"models:/gone/{mv.version}"
    for main, argv in ((generate, ["--model", model, "--prompt", "x", "-q"]),
                       (export, [model, "--out", str(tmp_path / "exported")]),
                       (serve, ["--model", model, "--port", "5999"]),
                       (evaluate, ["--model", model, "--suite", "ppl", "--in-process"])):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), (argv, err)
        line = err[0]
        assert f"the registry has version {mv.version} of gone but its files cannot be downloaded" in line, line
    assert not (tmp_path / "exported").exists()


# --------------------------------------------------------------------------------------------------------
# Serving over HTTP


def _post(app, body: bytes, content_type: str = "application/json", chunk: int = 0,
          declare: bool = True) -> tuple[int, bytes, int]:
    """POST ``body`` to an ASGI app's /invocations as uvicorn hands it over (in ``chunk``-byte pieces, with or
    without a Content-Length); (status, answer, how many of the body's bytes the app read)."""
    import asyncio

    pieces = [body[i:i + chunk] for i in range(0, len(body), chunk)] if chunk else [body]
    headers = [(b"content-type", content_type.encode())] + ([(b"content-length", str(len(body)).encode())]
                                                             if declare else [])
    scope = {"type": "http", "method": "POST", "path": "/invocations", "raw_path": b"/invocations", "headers": headers,
             "query_string": b"", "http_version": "1.1", "scheme": "http", "root_path": "",
             "server": ("127.0.0.1", 5001), "client": ("127.0.0.1", 40000)}
    sent: list[dict] = []
    read = 0

    async def receive() -> dict:
        nonlocal read
        if not pieces:
            await asyncio.sleep(3600)  # the client waits for the answer: no more body, no disconnect
        piece = pieces.pop(0)
        read += len(piece)
        return {"type": "http.request", "body": piece, "more_body": bool(pieces)}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"), read


def test_the_server_refuses_large_and_unparsable_bodies_without_echoing_them(registry, monkeypatch) -> None:
    """MLflow's scoring app (what ``mlflow models serve`` runs) behind the request guard of
    ``python -m pipelines.serve``: a body over the limit is refused with 413 before more of it is read; a body
    that is not JSON, not UTF-8 or not ``application/json`` gets a short 4xx, never the body; NaN, infinities and
    negative or fractional lengths are 400; a megabyte prompt is refused before it is tokenized. Every answer is
    one short line; a good request still gets its text."""
    import mlflow
    from mlflow.pyfunc import scoring_server

    from pipelines.serving.server import RequestGuard

    app = RequestGuard(scoring_server.init(mlflow.pyfunc.load_model("models:/adlm@candidate")), max_body=1 << 20)
    encoded: list[str] = []
    real_encode = TextGenerator._encode

    def counting(self, text: str, what: str) -> list[int]:
        encoded.append(what)
        return real_encode(self, text, what)

    monkeypatch.setattr(TextGenerator, "_encode", counting)

    def refused(body: bytes, status: int, line: str, **kw) -> int:
        got, answer, read = _post(app, body, **kw)
        assert got == status and len(answer) < 1000, (got, answer[:300])
        reply = json.loads(answer)
        assert line in reply["message"] and "\n" not in reply["message"], reply
        return read

    big = b"x" * (2 << 20)
    assert refused(big, 413, "larger than the server's limit of 1,048,576 bytes (ADLM_MAX_BODY_BYTES)") == 0
    # no Content-Length (chunked): read up to the limit, then refused
    assert refused(big, 413, "larger than the server's limit", chunk=64 << 10, declare=False) <= (1 << 20) + (64 << 10)
    refused(b"x" * 900_000, 400, "the body is not JSON (Expecting value at line 1 column 1)")
    refused(b"\xff\xfe" * 400_000, 400, "the body is not UTF-8 (byte 0 cannot be decoded)")
    refused(b"prompt,length\nx,4\n", 415, "takes Content-Type application/json (charset=utf-8 its only parameter)",
            content_type="text/csv")
    for value, line in (("NaN", "holds NaN"), ("Infinity", "holds Infinity"), ("-Infinity", "holds -Infinity"),
                        ("1e999", "a number too large for a float"), ("-3", "length must be >= 1"),
                        ("2.5", "length must be an integer, got 2.5")):
        refused(b'{"dataframe_records": [{"prompt": "x", "length": %s}]}' % value.encode(), 400, line)
    prompt = json.dumps({"dataframe_records": [{"prompt": "And God said " * 77_000, "length": 4}]}).encode()
    assert 1_000_000 < len(prompt) < 1 << 20
    encoded.clear()
    refused(prompt, 400, "request row 0: prompt and suffix of 1,001,000 characters exceed the limit max_chars=1,024 "
                         "(ADLM_MAX_CHARS)")
    assert encoded == []  # refused before the tokenizer saw it
    # whatever MLflow's own parsing refuses comes back cut to one line, not with the request in it
    refused(json.dumps({"dataframe_split": {"columns": ["prompt"], "data": "y" * 500_000}}).encode(), 400, "")
    status, answer, _ = _post(app, json.dumps({"dataframe_records": [{"prompt": PROMPT, "length": 4, "steps": 4,
                                                                      "seed": 3}]}).encode())
    assert status == 200 and json.loads(answer)["predictions"][0]["text"].startswith(PROMPT)


def test_every_malformed_request_is_a_4xx_that_echoes_nothing(registry) -> None:
    """Malformed requests of every kind, each carrying a marker string: JSON nested 100,000 deep and a 5,000-digit
    integer (HTTP 500 with a traceback in the log before), 100 KB sampler and length strings, unknown keys and
    formats, content-type parameters (echoed up to 500 characters before), a lone surrogate. Each gets a 4xx whose
    one-line message holds none of what was sent; the server's own words (field names, samplers) stay."""
    import mlflow
    from mlflow.pyfunc import scoring_server

    from pipelines.serving.server import RequestGuard

    app = RequestGuard(scoring_server.init(mlflow.pyfunc.load_model("models:/adlm@candidate")), max_body=1 << 20)
    mark = "ECHO-" + "q" * 40

    def records(**row) -> bytes:
        return json.dumps({"dataframe_records": [{"prompt": "x", **row}]}).encode()

    bodies = {
        "nested 100,000 deep": (b"[" * 100_000 + b"]" * 100_000, "nested deeper than 32 levels"),
        "object nested 50,000 deep": (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "nested deeper than 32 levels"),
        "a 5,000-digit length": (b'{"dataframe_records": [{"prompt": "x", "length": ' + b"9" * 5000 + b"}]}",
                                 "an integer of more than 40 digits"),
        "a 100 KB sampler": (records(sampler=mark * 2500), "unknown sampler (the value sent)"),
        "a 100 KB length": (records(length=mark * 2500), "length must be a number, got (the value sent)"),
        "an unknown field": (records(**{mark: 1}), "unknown field(s) (the value sent); known: prompt, suffix"),
        "an unknown format": (json.dumps({mark: [1]}).encode(), "exactly one of the input fields"),
        "a bad kv_cache": (records(sampler="confidence", kv_cache=mark), "kv_cache must be one of off, prefix, dual"),
        "a bad stop_at_eos": (records(stop_at_eos=mark), "stop_at_eos must be true or false"),
        "columns of a split": (json.dumps({"dataframe_split": {"columns": [mark], "data": [[1, 2]]}}).encode(), ""),
        "a prompt holding the mask": (records(prompt="<|mask|>" + mark), "the prompt contains the mask token"),
        "a lone surrogate": (b'{"dataframe_records": [{"prompt": "\\ud800' + mark.encode() + b'"}]}',
                             "a lone surrogate escape"),
        "a list of anything": (json.dumps([mark]).encode(), "exactly one of the input fields"),
    }
    for what, (body, words) in bodies.items():
        status, answer, _ = _post(app, body)
        assert 400 <= status < 500 and len(answer) < 700, (what, status, answer[:300])
        message = json.loads(answer)["message"]
        assert mark[:9] not in message and words in message and "\n" not in message, (what, message)
    for content_type in (f"application/json; {mark}=1", f"application/json; charset={mark}", f"text/{mark}", ""):
        status, answer, _ = _post(app, records(length=4), content_type=content_type)
        assert status == 415 and mark[:9].encode() not in answer, (content_type, answer)
    status, answer, _ = _post(app, records(length=2, steps=2, seed=1), content_type="application/json; charset=UTF-8")
    assert status == 200 and json.loads(answer)["predictions"][0]["text"].startswith("x")


@pytest.mark.slow
def test_mlflow_models_serve_answers_with_text_and_refuses_bad_input(registry, tmp_path) -> None:
    with models_serve("models:/adlm@candidate", tmp_path / "serve.log", tmp_path) as url:
        # A batch: one prediction per row, each text framed by its own prompt and suffix.
        status, body = invocations(url, {"dataframe_records": [
            {"prompt": PROMPT, "suffix": SUFFIX, "length": 10, "steps": 16, "seed": 7},
            {"prompt": "And God said", "length": 5}]})
        assert status == 200, body
        first, second = body["predictions"]
        assert first["text"].startswith(PROMPT) and first["text"].endswith(SUFFIX) and first["new_tokens"] == 10
        assert first["seed"] == 7 and first["seconds"] > 0
        assert second["text"].startswith("And God said") and second["new_tokens"] == 5
        # Bad inputs: HTTP 400 with the one-line reason; the server stays up and keeps answering.
        for bad, reason in (({"prompt": "x", "steps": -2}, "steps must be >= 1, got -2"),
                            ({"prompt": "x", "sampler": "beam"}, "unknown sampler 'beam'"),
                            ({"prompt": "x", "length": 500}, "exceeds the model's context of 32")):
            status, body = invocations(url, {"dataframe_records": [bad]})
            assert status == 400 and body["error_code"] == "INVALID_PARAMETER_VALUE", body
            assert reason in body["message"] and body["message"].startswith("request row 0: "), body  # no echo
        assert http_ok(f"{url}/ping")
        status, body = invocations(url, {"inputs": {"prompt": [PROMPT], "suffix": [SUFFIX], "length": [10], "steps": [16],
                                              "seed": [7]}})
        assert status == 200 and body["predictions"][0]["text"] == first["text"]  # same seed, same text


@pytest.mark.slow
def test_pipelines_serve_starts_without_the_venv_on_path_and_limits_the_body(registry, tmp_path) -> None:
    """``python -m pipelines.serve`` started by the venv's interpreter from a shell whose PATH lacks the venv
    (where ``mlflow models serve`` fails with ``uvicorn: not found``): it serves, refuses a body over
    ``--max-body-bytes`` with 413 in one short line, and answers a good request with text."""
    import subprocess
    import time
    import urllib.error
    import urllib.request
    from pathlib import Path

    from tests.conftest import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PATH": "/usr/bin:/bin", "NO_PROXY": "127.0.0.1,localhost"}
    log = tmp_path / "serve.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "pipelines.serve", "--model", "models:/adlm@candidate",
                                 "--port", str(port), "--max-body-bytes", "100000", "-q"],
                                env=env, cwd=Path(__file__).resolve().parents[2], stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not http_ok(f"{url}/ping"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.5)
        req = urllib.request.Request(f"{url}/invocations", data=b"x" * 200_000,
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        answer = e.value.read()
        assert e.value.code == 413 and len(answer) < 300 and b"100,000 bytes" in answer, answer
        status, body = invocations(url, {"dataframe_records": [{"prompt": PROMPT, "length": 4, "steps": 4}]})
        assert status == 200 and body["predictions"][0]["text"].startswith(PROMPT), body
    finally:
        stop_group(proc)


# --------------------------------------------------------------------------------------------------------
# The pipeline's summary


def test_the_summary_shows_no_empty_sample_and_no_mauve_from_too_few_samples(art, workdir) -> None:
    """An AR champion that draws EOS right after BOS more often than not (its EOS logit raised): the summary
    shows and counts only samples with text, drawing more seeded batches for them; a MAUVE measured on 16
    samples reads n/a with its count, not as a figure."""
    import types

    import mlflow

    from adlm_model import build_model
    from pipelines.orchestration.profiles import profile
    from pipelines.orchestration.summary import champion_samples, summarize, summary_markdown

    tok = art["tok"]
    cfg = tiny_config(tok, "ar")
    model = build_model(cfg)
    with torch.no_grad():
        model.backbone.output_layer.linear.bias[tok.eos_id] = 6.0  # p(EOS) about 0.5 at every position
    ck = save_ckpt(workdir / "ck-eos", model, cfg, None, art["ar"] / "tokenizer.json", art["data"])
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    mv = register(ck, uri, kind="ar")
    client = mlflow.MlflowClient(uri)
    client.set_registered_model_alias("adlm", "champion", mv.version)
    for k, v in {"mauve": "0.9997", "mauve.samples": "16", "val_ppl": "300.5", "eval.status": "promoted"}.items():
        client.set_model_version_tag("adlm", mv.version, k, v)
    gen = _generator({"ar": ck}, "ar")
    first = gen.generate(gen.request(length=8, num_samples=2, seed=0))
    assert any(not g.completion.strip() for g in first)  # the first batch alone would show an empty sample
    trained = {"AR": types.SimpleNamespace(registered_version=mv.version)}  # what summarize reads of a TrainResult
    s = summarize(profile("demo"), uri, "adlm", tok.vocab_size, trained, None, {"total": 1.0})
    s["samples"] = champion_samples(s, str(workdir), uri, length=8, n=2)
    assert len(s["samples"]) == 2 and all(t.strip() for t in s["samples"])
    md = summary_markdown(s)
    assert "| n/a (too few samples: 16) |" in md and "0.9997" not in md and "1.000" not in md
    assert s["rows"][0]["mauve"] is None and "Champion sample 2: " in md
    assert all(line.split(": ", 1)[1].strip() for line in md.splitlines() if line.startswith("Champion sample"))
