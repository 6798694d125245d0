"""The importer's refusals (``python -m pipelines.import_model``, ``adlm_model.interop.safe_pickle``): a pickle cannot make
the loader allocate by a number it states, hand numpy anything but plain number data, nest its hyper-parameters
without bound or slip a Python 2 name past its checks; an empty, truncated or corrupt file, parts of the wrong type,
a --family its folder contradicts, a vocabulary its config and weights disagree on, a name or alias the registry
refuses and a mistyped path are one line each, exit 2, nothing registered; a Hub repository is fetched (from a
stand-in of the Hub on loopback) with its ``pytorch_model.bin`` when it has no safetensors."""

from __future__ import annotations

import json
import pickle
import re
import shutil
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from adlm_model.interop.safe_pickle import UnsafePickleError, load_pickled, resolve_global
from tests.pipelines.test_import_reference import FIXTURES, _sedd_reference_order


class _Allocates:
    """Pickles as a call of ``fn(*args)``: what a hostile file names (pickling it calls nothing)."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def _allocating() -> dict[str, _Allocates]:
    import numpy as np

    # private: the names numpy's pickles carry, needed to write the fixtures
    from numpy._core.multiarray import _reconstruct

    return {"bytearray(1 GiB)": _Allocates(bytearray, 1 << 30), "bytes(1 GiB)": _Allocates(bytes, 1 << 30),
            "numpy.ndarray((2**27,), object)": _Allocates(np.ndarray, (1 << 27,), "O"),
            "numpy _reconstruct(ndarray, (2**30,))": _Allocates(_reconstruct, np.ndarray, (1 << 30,), b"b")}


@pytest.mark.parametrize("what", ["bytearray(1 GiB)", "bytes(1 GiB)", "numpy.ndarray((2**27,), object)",
                                  "numpy _reconstruct(ndarray, (2**30,))"])
def test_a_pickle_cannot_make_the_loader_allocate_by_a_number_in_it(what: str, tmp_path: Path) -> None:
    """A file of under 200 bytes naming bytearray(1 GiB) (or bytes, or a numpy array of a stated size) is refused
    before anything is allocated: the peak of Python's allocations (tracemalloc sees bytes, bytearray and numpy's
    data) stays far below the size asked; a raw pickle and torch.save's zip format alike. numpy's own pickles
    (an empty placeholder, then the data) and bytes/bytearray of data still load."""
    import tracemalloc

    import numpy as np

    payload = _allocating()[what]
    raw, zipped = tmp_path / "raw.ckpt", tmp_path / "zip.ckpt"
    raw.write_bytes(pickle.dumps(payload, protocol=2))
    assert raw.stat().st_size < 200
    torch.save({"state_dict": {}, "hyper_parameters": {"x": payload}}, zipped)
    for f in (raw, zipped):
        tracemalloc.start()
        try:
            with pytest.raises(UnsafePickleError, match="allocates by a number in the file") as e:
                load_pickled(f)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 32 << 20, f"{what} ({f.name}): peak {peak / 2**20:.0f} MiB"
        assert "\n" not in str(e.value)
    ok = tmp_path / "np.pt"
    torch.save({"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": bytearray(b"ok"), "c": b"\x00\xff"}, ok)
    back = load_pickled(ok)
    assert back["a"].tolist() == [[0, 1, 2], [3, 4, 5]] and back["b"] == bytearray(b"ok") and back["c"] == b"\x00\xff"


class _Built(_Allocates):
    """Pickles as ``fn(*args)`` followed by ``__setstate__(state)``: numpy's own array pickle, with the state a
    hostile file chooses."""

    def __init__(self, fn, args, state) -> None:
        super().__init__(fn, *args)
        self.state = state

    def __reduce__(self):
        return (self.fn, self.args, self.state)


def _hostile_numpy() -> dict[str, tuple[object, str]]:
    """numpy objects a file of a few hundred bytes can name, each with the words of its refusal."""
    import numpy as np

    # private: the names numpy's pickles carry, needed to write the fixtures
    from numpy._core.multiarray import _reconstruct, scalar

    def array(shape, dtype, data):  # numpy's placeholder, then the state it is given
        return _Built(_reconstruct, (np.ndarray, (0,), b"b"), (1, shape, dtype, False, data))

    return {
        # an object array given fewer items than its shape: numpy filled the rest from memory it never wrote and
        # the process died (SIGSEGV), after zeroing a gigabyte for the large one
        "object array (1,000)": (array((1000,), np.dtype("O"), [1]), "numpy dtype 'O8'"),
        "object array (2**27)": (array((1 << 27,), np.dtype("O"), []), "numpy dtype 'O8'"),
        "object array by its type code": (_Built(_reconstruct, (np.ndarray, (0,), b"O"), (1, (9,), np.dtype("f4"),
                                                                                          False, b"")),
                                          "numpy dtype 'O'"),
        "float array (2**27) of 8 bytes": (array((1 << 27,), np.dtype("f4"), b"A" * 8), "with 8 bytes of data for"),
        "scalar of dtype V1073741824": (_Allocates(scalar, np.dtype("V1073741824"), b"x"), "numpy dtype 'V1073741824'"),
        "structured dtype": (array((1,), np.dtype([("a", "O")]), b"A" * 8), "numpy dtype 'V8'"),
    }


@pytest.mark.parametrize("what", list(_hostile_numpy()))
def test_numpy_in_a_pickle_is_checked_before_numpy_reads_it(what: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """numpy builds its objects in native code: an object array holding the file's bytes as pointers crashed the
    importer (SIGSEGV), a void scalar of a stated gigabyte was allocated before numpy refused it. Each is refused
    in one line before numpy sees it (the peak of Python's allocations stays far below the size asked), by the
    importer too, which registers nothing; numpy's plain arrays and scalars, either byte order, still load."""
    import tracemalloc

    import numpy as np

    payload, words = _hostile_numpy()[what]
    f = tmp_path / "hostile.ckpt"
    f.write_bytes(pickle.dumps(payload, protocol=2))
    assert f.stat().st_size < 300
    tracemalloc.start()
    try:
        with pytest.raises(UnsafePickleError) as e:
            load_pickled(f)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20 and words in str(e.value) and "\n" not in str(e.value), (peak, str(e.value))
    from pipelines.import_model import main

    zipped = tmp_path / "zipped.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "hyper_parameters": {"x": payload}}, zipped)
    assert main([str(zipped), "--workdir", str(tmp_path / "wd")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
    assert not (tmp_path / "wd" / "mlflow.db").exists() and not (tmp_path / "wd" / "mlartifacts").exists()  # nothing registered
    ok = tmp_path / "plain.ckpt"
    big_endian = np.arange(4, dtype=">f8")
    torch.save({"a": np.arange(6, dtype=np.int16).reshape(3, 2), "b": big_endian, "c": np.float64(1.5),
                "d": np.bool_(True), "e": np.zeros((0, 3), np.complex64)}, ok)
    back = load_pickled(ok)
    assert back["a"].tolist() == [[0, 1], [2, 3], [4, 5]] and back["a"].dtype == np.int16
    assert back["b"].tolist() == [0.0, 1.0, 2.0, 3.0] and back["c"] == 1.5 and back["d"] and back["e"].shape == (0, 3)


def _as_torch_zip(pkl: bytes, out: Path) -> Path:
    """``pkl`` as the pickle of a torch.save zip (its other records from an empty save)."""
    import io
    import zipfile

    buf = io.BytesIO()
    torch.save({}, buf)
    with zipfile.ZipFile(buf) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for name in src.namelist():
            dst.writestr(name, pkl if name.endswith("/data.pkl") else src.read(name))
    return out


def test_deep_hyper_parameters_and_storages_larger_than_the_file_are_one_line(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Hyper-parameters nested 5,000 deep (a 40 KB file) gave a RecursionError of 2,995 lines; a legacy-format file
    whose storage declares 8 GB had them allocated before its data were read. Both are one line, exit 2, nothing
    registered; a config.json nested 100,000 deep likewise."""
    from pipelines.import_model import main

    def s(x: str) -> bytes:
        return b"X" + len(x.encode()).to_bytes(4, "little") + x.encode()

    n = 5000  # {'state_dict': {}, 'hyper_parameters': {'a': {'a': ... {}}}}, written opcode by opcode
    deep = b"\x80\x02}" + s("state_dict") + b"}s" + s("hyper_parameters") + (b"}" + s("a")) * n + b"}" + b"s" * n + b"s."
    _as_torch_zip(deep, tmp_path / "deep.ckpt")
    import io

    buf = io.BytesIO()
    torch.save({"state_dict": {"w": torch.zeros(4)}}, buf, _use_new_zipfile_serialization=False)
    # the storage's element count (4, after its location 'cpu') made 2**31 - 1
    raw, hits = re.subn(rb"(X\x03\x00\x00\x00cpuq.)K\x04", lambda m: m.group(1) + b"J\xff\xff\xff\x7f", buf.getvalue())
    assert hits == 1
    (tmp_path / "legacy.ckpt").write_bytes(raw)
    hub = tmp_path / "deep-json"
    hub.mkdir()
    (hub / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    (hub / "model.safetensors").write_bytes(b"\x00" * 16)
    for source, words in ((tmp_path / "deep.ckpt", "nested deeper than 100 levels"),
                          (tmp_path / "legacy.ckpt", "storages of 8,589,934,588 bytes in a file of"),
                          (hub, "JSON nested too deep")):
        assert main([str(source), "--workdir", str(tmp_path / "wd")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
    assert not (tmp_path / "wd" / "mlflow.db").exists() and not (tmp_path / "wd" / "mlartifacts").exists()


def test_a_compressed_record_is_refused_before_it_is_inflated(tmp_path: Path) -> None:
    """torch.save stores its records uncompressed; a zip whose deflated record declares 64 MiB in a file of a few
    kilobytes would be inflated whole: refused from the zip's directory, before torch reads a record."""
    import tracemalloc
    import zipfile

    plain_file, bomb = tmp_path / "plain.ckpt", tmp_path / "bomb.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(4)}}, plain_file)
    with zipfile.ZipFile(plain_file) as src, zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as out:
        for name in src.namelist():
            if name.endswith("data/0"):
                with out.open(name, "w") as f:
                    for _ in range(64):
                        f.write(bytes(1 << 20))
            else:
                out.writestr(name, src.read(name))
    assert bomb.stat().st_size < 200_000
    tracemalloc.start()
    try:
        with pytest.raises(UnsafePickleError, match="allocates by a number in the file: a compressed record"):
            load_pickled(bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20
    assert load_pickled(plain_file)["state_dict"]["w"].shape == (4,)


def test_python2_names_are_mapped_before_the_checks(tmp_path: Path) -> None:
    """``commands.Popen`` (Python 2's name of ``subprocess.Popen``) is read as pickle reads it, then refused (it
    passed as an inert stand-in before); the builtins old pickles name (``__builtin__.long``) still resolve."""
    from adlm_model.interop.safe_pickle import compat_name

    assert compat_name("commands", "Popen") == ("subprocess", "Popen")
    f = tmp_path / "py2.ckpt"
    # protocol 2: GLOBAL 'commands Popen', the argument tuple ('true',), REDUCE
    f.write_bytes(b"\x80\x02ccommands\nPopen\nX\x04\x00\x00\x00true\x85R.")
    with pytest.raises(UnsafePickleError, match="subprocess.Popen"):
        load_pickled(f)
    for module, name in (("commands", "getoutput"), ("__builtin__", "eval"), ("exceptions", "Exception")):
        with pytest.raises(UnsafePickleError):
            resolve_global(module, name)
    assert resolve_global("__builtin__", "long") is int and resolve_global("copy_reg", "_reconstructor") is not None


def _bad_sources(tmp: Path) -> list[tuple[list[str], str]]:
    """Sources a user can get wrong, each with the words its one-line refusal must hold."""
    good = (FIXTURES / "mdlm" / "mdlm.ckpt").read_bytes()
    (tmp / "empty.ckpt").write_bytes(b"")
    (tmp / "truncated.ckpt").write_bytes(good[:len(good) // 2])
    corrupt = bytearray(good)
    start = good.index(b"data.pkl") + 200  # inside the pickle of the zip's first record
    corrupt[start:start + 64] = bytes(range(64))
    (tmp / "corrupt.ckpt").write_bytes(bytes(corrupt))
    torch.save({"state_dict": OrderedDict(w=torch.zeros(2)), "hyper_parameters": [1, 2]}, tmp / "hp-list.ckpt")
    torch.save({"state_dict": [torch.zeros(2)]}, tmp / "state-list.ckpt")
    hub = tmp / "bad-json"
    hub.mkdir()
    (hub / "config.json").write_text("{not json")
    (hub / "model.safetensors").write_bytes(b"\x00" * 16)
    (tmp / "exported").mkdir()
    (tmp / "my_models").mkdir()
    export = tmp / "export"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"model_type": "adlm", "model": {"kind": "mdlm"}}))
    save_file({"w": torch.zeros(2)}, str(export / "model.safetensors"))
    vocab = tmp / "vocab-400"
    shutil.copytree(FIXTURES / "ssdlm" / "hub", vocab)
    (vocab / "config.json").write_text(json.dumps({**json.loads((vocab / "config.json").read_text()), "vocab_size": 400}))
    sf = tmp / "bad-safetensors"
    sf.mkdir()
    (sf / "config.json").write_text(json.dumps({"model_type": "mdlm"}))
    (sf / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    return [
        ([str(tmp / "empty.ckpt")], "empty"),
        ([str(tmp / "truncated.ckpt")], "not a readable torch.save checkpoint (truncated or corrupt"),
        ([str(tmp / "corrupt.ckpt")], "not a readable torch.save checkpoint (truncated or corrupt"),
        ([str(tmp / "hp-list.ckpt")], "'hyper_parameters' is a list, not a mapping"),
        ([str(tmp / "state-list.ckpt")], "'state_dict' is not a state dict of named tensors"),
        ([str(hub)], "config.json is not readable JSON"),
        ([str(sf)], "model.safetensors is not a readable safetensors file"),
        # a BD3-LM Hub folder read as MDLM would attend to every position: refused, naming the family to pass
        ([str(FIXTURES / "bd3lm-block4"), "--family", "mdlm"], "model_type 'bd3lm', family bd3lm; pass --family bd3lm"),
        # mistyped relative paths are missing files, never Hub ids
        (["ckpts/mdlm.ckpt"], "ckpts/mdlm.ckpt: no such file or folder"),
        (["./ckpts/mdlm"], "no such file or folder"),
        (["../mdlm"], "no such file or folder"),
        (["models/sedd/run"], "no such file or folder"),
        # owner/name whose owner is a folder here: a local path whose last part is missing, never a Hub id
        (["exported/adlm"], "exported/adlm: no such file or folder"),
        (["my_models/ckpt-final"], "my_models/ckpt-final: no such file or folder"),
        # names and aliases the registry refuses, before anything is read (they failed after 44 files were logged)
        ([str(FIXTURES / "mdlm" / "mdlm.ckpt"), "--name", "a/b"], "--name: Invalid model name 'a/b'"),
        ([str(FIXTURES / "mdlm" / "mdlm.ckpt"), "--alias", "bad alias!"], "--alias: Invalid alias name"),
        ([str(FIXTURES / "mdlm" / "mdlm.ckpt"), "--alias", "v3"], "--alias: Version alias name 'v3' is reserved"),
        # the export family on a released checkpoint (a KeyError), and a released family on an export folder
        ([str(FIXTURES / "mdlm" / "mdlm.ckpt"), "--family", "adlm-export"],
         "--family adlm-export reads this project's export folders; this source is a Lightning .ckpt"),
        ([str(export), "--family", "mdlm"], "--family mdlm reads released checkpoints, not this project's export"),
        # a Hub folder whose config.json and weights disagree on the vocabulary
        ([str(vocab)], "config.json says vocab_size 400 but the weights' token embedding"),
    ]


def test_unreadable_and_mistaken_sources_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A corrupt, truncated or empty .ckpt, hyper-parameters or weights of the wrong type, a broken Hub folder, a
    --family its folder's own model_type contradicts, a mistyped relative path: one `error:` line each, exit 2,
    no traceback, nothing registered (and no Hub download attempted: HF_HUB_OFFLINE would name the Hub)."""
    from pipelines.import_model import main

    monkeypatch.chdir(tmp_path)
    wd = tmp_path / "wd"
    for argv, needle in _bad_sources(tmp_path):
        assert main([*argv, "--workdir", str(wd)]) == 2, argv
        err = [ln for ln in capsys.readouterr().err.strip().splitlines() if "(pid=" not in ln[:40]]
        assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], (argv, err)
        assert "Hub" not in err[0] or "Hub id is owner/name" in err[0], err
    # owner/name with no such folder here: tried on the Hub (offline here), and the message says it is no local path
    assert main(["nothere/adlm", "--workdir", str(wd)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: nothere/adlm: no such local file or folder (in {tmp_path}), "
                                               "and cannot download nothere/adlm from the Hugging Face Hub"), err
    assert not (wd / "mlflow.db").exists() and not (wd / "mlartifacts").exists()


def test_a_hub_id_without_safetensors_is_fetched_with_its_pytorch_model_bin(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """``import_model owner/name`` against a stand-in of the Hub (``huggingface_hub`` downloading for real over
    loopback): a repository holding only ``pytorch_model.bin`` (older ``PyTorchModelHubMixin``) is fetched with it
    and read as SEDD; one holding safetensors too is fetched without the pickle. A repository the Hub does not know
    is one line."""
    from pipelines.import_model import main
    from tests.support.hub import hub_models

    prov = json.loads((FIXTURES / "sedd" / "provenance.json").read_text())
    ref = load_file(str(FIXTURES / "sedd" / "weights.safetensors"))
    bin_path = tmp_path / "pytorch_model.bin"
    torch.save(OrderedDict(sorted(ref.items(), key=lambda kv: _sedd_reference_order(kv[0]))), bin_path)
    save_file(ref, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.dumps(prov["config"]).encode()
    repos = {"louaaron/sedd-tiny": {"config.json": config, "README.md": b"SEDD", "pytorch_model.bin": bin_path.read_bytes()},
             "louaaron/sedd-both": {"config.json": config, "model.safetensors": (tmp_path / "model.safetensors").read_bytes(),
                                    "pytorch_model.bin": bin_path.read_bytes()}}
    wd = tmp_path / "wd"
    with hub_models(repos, tmp_path / "hf-cache") as served:
        assert main(["louaaron/sedd-tiny", "--inspect", "--workdir", str(wd)]) == 0
        out = capsys.readouterr().out
        assert "family: sedd" in out and "pytorch_model.bin" in out.splitlines()[0], out[:400]
        assert "louaaron/sedd-tiny/pytorch_model.bin" in served
        assert main(["louaaron/sedd-both", "--inspect", "--workdir", str(wd)]) == 0
        assert "model.safetensors" in capsys.readouterr().out
        assert "louaaron/sedd-both/pytorch_model.bin" not in served and "louaaron/sedd-both/model.safetensors" in served
        assert main(["louaaron/sedd-nothing", "--workdir", str(wd)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: louaaron/sedd-nothing: no such local file or folder")
        assert "cannot download louaaron/sedd-nothing from the Hugging Face Hub" in err[0], err
    assert not (wd / "mlflow.db").exists()
