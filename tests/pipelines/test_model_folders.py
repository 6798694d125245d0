"""Model folders, versions and devices a user can get wrong, each one ``error:`` line and exit 2 before any work:
an export folder whose weights, config.json or tokenizer.json are damaged, or whose config.json asks for a network
far larger than its weights (refused before a tensor is made); a device this machine lacks; a prompt that is not
UTF-8. And ``export --force`` replaces an earlier export's files without deleting anyone else's. (A registered
version whose files were deleted: ``test_serving``, which has a registry.)

Cheap: a random tiny MDLM with a real 384-entry BPE, exported once; no registry."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support.eval import kjv_verses, make_tokenizer, save_ckpt, tiny_config
from tests.support.models import randomized


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from pipelines.serving.export import export_model

    root = tmp_path_factory.mktemp("model-folders")
    tok, tok_path = make_tokenizer(root, kjv_verses(300))
    cfg = tiny_config(tok, "mdlm")
    ckpt = save_ckpt(root / "ckpt", randomized(cfg), cfg, None, tok_path, root)
    export_model(str(ckpt), root / "export")
    return {"root": root, "ckpt": ckpt, "export": root / "export"}


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def _edited(src: Path, dst: Path, change) -> Path:
    shutil.copytree(src, dst)
    change(dst)
    return dst


def _config(**model) -> callable:
    def change(d: Path) -> None:
        c = json.loads((d / "config.json").read_text())
        c["model"].update(model)
        (d / "config.json").write_text(json.dumps(c))

    return change


def test_a_damaged_or_edited_export_folder_is_one_line(folders, tmp_path, capsys, monkeypatch) -> None:
    """Garbage weights, a config.json that is not JSON or holds no model, a garbage tokenizer.json: one line each
    (tracebacks before). A config.json asking for 4,096 blocks or a hidden size of 2^20 is refused from the
    weights file's header, before any network is built (it allocated 5 GB, then a traceback); importing such a
    folder likewise."""
    import torch

    import adlm_model.interop.checkpoint as checkpoint
    import adlm_model.interop.reference_layouts as layouts
    from pipelines.generate import main as generate
    from pipelines.import_model import main as import_model

    built = []  # networks built on a real device (the size check counts on the meta device, allocating nothing)
    real = checkpoint.build_model
    for module in (checkpoint, layouts):
        monkeypatch.setattr(module, "build_model",
                            lambda cfg: (torch.empty(0).device.type != "meta" and built.append(cfg)) or real(cfg))
    exp = folders["export"]
    cases = [
        (lambda d: (d / "model.safetensors").write_bytes(b"garbage"), "model.safetensors is not a readable safetensors"),
        (lambda d: (d / "config.json").write_text("{not json"), "config.json is not readable JSON"),
        (lambda d: (d / "config.json").write_text(json.dumps({"model_type": "adlm", "mask_token_id": 1})),
         "config.json holds no model config"),
        (lambda d: (d / "tokenizer.json").write_text("garbage"), "tokenizer.json is not a readable tokenizer.json"),
        (_config(n_blocks=4096), "describes a network of"),
        (_config(hidden=2**20), "describes a network of"),
    ]
    for i, (change, words) in enumerate(cases):
        d = _edited(exp, tmp_path / f"case{i}", change)
        assert generate(["--model", str(d), "--prompt", "x", "--length", "4", "--steps", "2", "-q"]) == 2
        line = _one_line(capsys)
        assert words in line, (i, line)
        if words == "describes a network of":  # importing the folder: refused before its network is built too
            assert import_model([str(d), "--workdir", str(tmp_path / "wd")]) == 2
            assert "describes a mdlm network of" in _one_line(capsys)
    assert not built  # no network was built for any of them
    assert not (tmp_path / "wd" / "mlflow.db").exists() and not (tmp_path / "wd" / "mlartifacts").exists()  # nothing registered
    assert generate(["--model", str(exp), "--prompt", "x", "--length", "4", "--steps", "2", "-q"]) == 0
    assert capsys.readouterr().out.startswith("x") and len(built) == 1


@pytest.mark.parametrize("argv, words", [
    (["--device", "banana"], "device 'banana' is not a device: use auto, cpu, cuda or cuda:N"),
    (["--device", "meta"], "generation runs on cpu or cuda[:N]"),
    (["--device", "cuda"], "this machine has no CUDA device"),
    (["--device", "cuda:99"], "cuda:99"),
    (["--prompt", "caf\udce9"], "the prompt is not valid UTF-8 text (character 3 cannot be encoded)"),
    (["--suffix", "\ud800"], "the suffix is not valid UTF-8 text (character 0"),
])
def test_a_device_or_text_that_cannot_be_used_is_refused_before_the_model_is_read(argv, words, tmp_path,
                                                                                  capsys) -> None:
    """A device string torch does not know, a CUDA device this machine lacks, text that is not UTF-8 (bytes a
    shell passed undecoded): one line, before the model is even looked for (the folder here does not exist)."""
    import torch

    from pipelines.generate import main as generate

    if "cuda" in argv[-1] and torch.cuda.is_available() and argv[-1] == "cuda":
        pytest.skip("this machine has CUDA")
    assert generate(["--model", str(tmp_path / "absent"), "--prompt", "x", *argv, "-q"]) == 2
    assert words in _one_line(capsys)


def test_export_force_replaces_only_what_an_export_writes(folders, tmp_path, capsys) -> None:
    """--force over an earlier export replaces the export's files and keeps every other one (it deleted the
    user's file beside a config.json saying model_type adlm); --out under a file is one line, nothing written."""
    from adlm_model.interop.pretrained import load_pretrained
    from pipelines.export import main as export
    from pipelines.serving.export import EXPORT_FILES

    out = tmp_path / "out"
    assert export([str(folders["ckpt"]), "--out", str(out)]) == 0
    assert {f.name for f in out.iterdir()} == set(EXPORT_FILES)
    (out / "notes.txt").write_text("mine")
    (out / ".git").mkdir()
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main")
    (out / "model.safetensors").write_bytes(b"stale")
    capsys.readouterr()
    assert export([str(folders["ckpt"]), "--out", str(out)]) == 2
    assert "pass --force" in _one_line(capsys)
    assert export([str(folders["ckpt"]), "--out", str(out), "--force"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / ".git" / "HEAD").is_file()
    load_pretrained(out)  # the stale weights were replaced
    assert not list(tmp_path.glob(".out-*"))  # the staging folder is gone

    mine = tmp_path / "mine"  # the user's own folder, whose config.json happens to say model_type adlm
    mine.mkdir()
    (mine / "config.json").write_text(json.dumps({"model_type": "adlm"}))
    (mine / "train.py").write_text("print('mine')")
    assert export([str(folders["ckpt"]), "--out", str(mine), "--force"]) == 0
    assert (mine / "train.py").read_text() == "print('mine')" and (mine / "model.safetensors").is_file()

    capsys.readouterr()
    (tmp_path / "a-file").write_text("x")
    assert export([str(folders["ckpt"]), "--out", str(tmp_path / "a-file" / "sub")]) == 2
    assert "a-file is a file, not a folder" in _one_line(capsys)
    assert (tmp_path / "a-file").read_text() == "x"
