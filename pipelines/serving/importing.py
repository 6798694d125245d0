"""The machinery of ``python -m pipelines.import_model`` (docs/usage/released-models.md): fetch the source (a Hub id
through ``huggingface_hub``, an object store, a local path), read it with ``adlm_model.interop.reference_layouts`` (no
code of the checkpoint runs), pick the tokenizer the model was trained with, and register the mapped weights as a
version like a trained one (``registry.register_checkpoint``), tagged with its provenance. Every refusal is one
line, raised before anything is written to the registry."""

from __future__ import annotations

import json
import logging
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipelines.core.storage import (
    StorageError,
    download_dir,
    exists,
    get_fs,
    hub_errors,
    is_file,
    is_uri,
    local_path,
    resolve_workdir,
    sha256_file,
)
from pipelines.data.tokenizer import TokenizerError, bpe_from_files, load_tokenizer
from pipelines.tracking.registry import DEFAULT_MODEL_NAME, check_names, register_checkpoint, training_tags
from pipelines.tracking.runs import client, ensure_experiment, find_or_create_run, resolve_tracking_uri

log = logging.getLogger("adlm.import")

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "README.md", "LICENSE*", "*.pt",
             "vocab.json", "merges.txt"]
"""What a Hub import downloads: the weights as safetensors, the small modules and tokenizer files some families keep
beside them (SSD-LM's ``embed_sum_layer.pt``, ``timestep_layer.pt``, RoBERTa's ``vocab.json`` / ``merges.txt``)."""
HUB_PICKLE_FILES = ["pytorch_model.bin"]
"""Downloaded only when a Hub folder has no safetensors (older ``PyTorchModelHubMixin`` releases and older uploads
such as xhan77/ssdlm saved this), read through ``adlm_model.interop.safe_pickle``."""
PATH_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".safetensors", ".json", ".yaml")
# The tokenizer a released model was trained with, by its embedding width (vocabulary + appended mask).
DEFAULT_TOKENIZERS = {50258: "gpt2", 30522: "bert-base-uncased"}
EXPERIMENT = "imports"


class ImportInputError(ValueError):
    """Bad input to the importer: one line, before any registry write."""


def fetch_source(source: str, revision: str | None, tmp: Path) -> tuple[Path, str]:
    """A local path for ``source`` and what kind it was (``local``, ``uri``, ``hub``)."""
    if is_uri(source):
        try:
            if is_file(source):
                fs, inner = get_fs(source)
                dst = tmp / Path(inner).name
                with fs.open_input_stream(inner) as f, open(dst, "wb") as out:
                    while chunk := f.read(1 << 22):
                        out.write(chunk)
                return dst, "uri"
            if exists(source):
                return download_dir(source, tmp / "download"), "uri"
        except (OSError, StorageError) as e:
            raise ImportInputError(f"cannot read {source} ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                                   "check the URI and the object store's credentials") from None
        raise ImportInputError(f"{source} does not exist in the object store")
    local = local_path(source)
    if local is not None and local.exists():
        if revision:
            raise ImportInputError("--revision applies to a Hub id only, not to a local path")
        return local, "local"
    if looks_like_path(source) or _local_parent(source):
        raise ImportInputError(f"{source}: no such file or folder (a Hub id is owner/name, without a file suffix); "
                               "check the path")
    try:
        return hub_snapshot(source, revision), "hub"
    except ImportInputError as e:  # owner/name is a relative path too: say that none exists here either
        raise ImportInputError(f"{source}: no such local file or folder (in {Path.cwd()}), and {e}") from None


def _local_parent(source: str) -> bool:
    """``owner/name`` whose ``owner`` is a folder here (``exported/adlm``, ``my_models/ckpt-final``): a local path
    whose last part is missing, not a Hub id."""
    head = source.split("/", 1)[0]
    return "/" in source and Path(head).is_dir()


def looks_like_path(source: str) -> bool:
    """A source that cannot be a Hub id (``owner/name``) and so names a missing local file: a ``file://`` URI,
    an absolute, home or ``./``/``../`` path, a checkpoint file suffix, or anything else the Hub id pattern
    refuses (``a/b/c``)."""
    return (source.startswith(("file://", "/", "~", "./", "../")) or source.lower().endswith(PATH_SUFFIXES)
            or not HUB_ID.match(source) or ".." in source)


def hub_snapshot(repo: str, revision: str | None) -> Path:
    """The Hub folder of ``repo`` (the Hugging Face cache, HF_HOME: a second import of the same revision
    downloads nothing): config and safetensors; ``pytorch_model.bin`` too when the folder has no safetensors."""
    # lazy: keeps huggingface_hub out of this module's import
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id=repo, revision=revision, allow_patterns=HUB_FILES))
        if not any(path.glob("*.safetensors")):
            path = Path(snapshot_download(repo_id=repo, revision=revision,
                                          allow_patterns=HUB_FILES + HUB_PICKLE_FILES))
    except hub_errors() as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ImportInputError(f"cannot download {repo}{'@' + revision if revision else ''} from the Hugging Face "
                               f"Hub ({type(e).__name__}: {first[:160]}); with no network, download the folder "
                               "elsewhere and pass its path") from None
    return path


def _sha256(files: list[Path]) -> dict[str, str]:
    return {f.name: sha256_file(f) for f in files}


def _tokenizer_file(spec: str) -> list[Path]:
    """The local tokenizer.json a ``--tokenizer`` spec names (a file, or a folder holding one); none for a name."""
    p = Path(spec).expanduser()
    f = p / "tokenizer.json" if p.is_dir() else p
    return [f] if f.is_file() else []


def _tokenizer_from_files(spec: str | None, fam: Any, local: Path, source: str) -> tuple[Any, list[Path]]:
    """The tokenizer of a family that ships its own files (``Family.tokenizer_files``): from ``--tokenizer`` (a
    folder holding them, or a tokenizer.json), else from the released folder, else one line naming what to pass;
    with the files it was read from."""
    files = " + ".join(fam.tokenizer_files)
    folder = Path(spec).expanduser() if spec else (local if local.is_dir() else local.parent)
    try:
        if folder.is_dir() and all((folder / f).is_file() for f in fam.tokenizer_files):
            return bpe_from_files(str(folder / fam.tokenizer_files[0]), str(folder / fam.tokenizer_files[1])), [
                folder / f for f in fam.tokenizer_files]
        if spec:
            return load_tokenizer(spec), _tokenizer_file(spec)
    except TokenizerError as e:
        raise ImportInputError(str(e)) from None
    raise ImportInputError(f"the {fam.name} model's tokenizer ({files}) is not in {source} and no installed package "
                           f"ships it: pass --tokenizer DIR holding its {' and '.join(fam.tokenizer_files)} (the "
                           "released Hub folder holds them)")


def _tokenizer(spec: str | None, src: Any, width: int, local: Path, fam: Any = None,
               source: str = "") -> tuple[Any, list[Path]]:
    """The tokenizer the model was trained with and the files it was read from (none for a named one such as
    gpt2, which comes from an installed package)."""
    if fam is not None and fam.tokenizer_files:
        tok, read = _tokenizer_from_files(spec, fam, local, source)
        if tok.width != width:
            raise ImportInputError(f"tokenizer {tok.name!r} (vocabulary {tok.vocab_size}, width {tok.width}) does not "
                                   f"fit the checkpoint's embedding of {width} rows; pass the tokenizer the model was "
                                   "trained with (--tokenizer)")
        return tok, read
    if spec is None and src.layout == "export":
        spec = str(local / "tokenizer.json")
    if spec is None:
        spec = DEFAULT_TOKENIZERS.get(width)
    if spec is None:
        raise ImportInputError(f"the checkpoint's embedding has {width} rows, which names no released tokenizer "
                               "(50258: gpt2 with the mask appended, 30522: bert-base-uncased); pass --tokenizer")
    try:
        tok = load_tokenizer(spec)
    except TokenizerError as e:
        raise ImportInputError(str(e)) from None
    if tok.width != width:
        raise ImportInputError(f"tokenizer {tok.name!r} (vocabulary {tok.vocab_size}, mask {tok.mask_id}: width "
                               f"{tok.width}) does not fit the checkpoint's embedding of {width} rows; pass the "
                               "tokenizer the model was trained with (--tokenizer)")
    return tok, _tokenizer_file(spec)


def inspect_lines(src: Any, fam: Any | None, files: list[Path]) -> list[str]:
    # lazy: keeps torch out of this module's import
    from adlm_model.interop.reference_layouts import key_tree

    lines = [f"layout: {src.layout}; files: {', '.join(str(f) for f in files)}",
             f"family: {fam.name if fam else 'not recognised'}"
             + (f" (kind {fam.kind or 'from its config'}; layout of {fam.reference})" if fam else ""),
             f"tensors ({len(src.tensors)}):", *("  " + line for line in key_tree(src.tensors))]
    if src.ema is not None:
        lines.append(f"ema: {len(src.ema)} shadow parameters")
    if src.extra:
        lines.append(f"lightning: {json.dumps(src.extra, sort_keys=True)}")
    lines.append("hyper-parameters:")
    lines += ["  " + line for line in json.dumps(src.hparams, indent=2, sort_keys=True, default=str).splitlines()]
    return lines


def import_model(source: str, *, name: str | None = None, revision: str | None = None, family: str | None = None,
                 tokenizer: str | None = None, inspect: bool = False, aliases: Sequence[str] | None = None,
                 workdir: str | None = None, tracking_uri: str | None = None) -> dict[str, Any]:
    """Import ``source``; returns what was registered (or, with ``inspect``, what was read: ``lines`` is the key
    tree, shapes and hyper-parameters, which the command prints). Raises ImportInputError /
    ImportRefused / UnsafePickleError (one line each) before any registry write."""
    # lazy: keeps torch out of this module's import
    from adlm_model.interop import reference_layouts as rl
    from adlm_model.interop.checkpoint import save_checkpoint
    from adlm_model.kinds import parameter_count
    check_names(name, aliases or ())  # before anything is fetched, read or registered
    with tempfile.TemporaryDirectory(prefix="adlm-import-") as tmp_s:
        tmp = Path(tmp_s)
        local, where = fetch_source(source, revision, tmp)
        src = rl.read_source(local)
        if inspect:
            try:
                fam = rl.chosen_family(family, src)
            except rl.ImportRefused:
                fam = None
            return {"inspected": str(local), "family": fam.name if fam else None, "tensors": len(src.tensors),
                    "lines": inspect_lines(src, fam, src.files)}
        fam = rl.chosen_family(family, src)
        width = rl.embedding_width(src, fam)
        tok, tok_files = _tokenizer(tokenizer, src, width, local, fam, source)
        model, cfg = rl.convert(src, fam, tok.vocab_size, tok.mask_id)
        # every file read, the tokenizer's among them (the same weights with another vocabulary are another model);
        # a tokenizer read from no file here (gpt2 from its package) by its content
        digests = _sha256([*src.files, *(f for f in tok_files if f not in src.files)])
        if not tok_files:
            digests[f"tokenizer {tok.name}"] = tok.content_hash
        # a Hub snapshot's folder is named after the commit it resolved to: the revision recorded
        hub_revision = local.name if where == "hub" else (revision or "")
        provenance = {"source": str(local.resolve()) if where == "local" else source, "source_kind": where, "revision": hub_revision, "family": fam.name,
                      "reference": fam.reference, "reference_commit": fam.commit, "license": fam.license,
                      "sha256": digests, "ema": src.ema is not None, **src.extra}
        # The checkpoint folder in our layout: the weights (EMA already in place), config, tokenizer.
        ckpt = save_checkpoint(tmp / "checkpoint", model, cfg, meta={
            "imported": provenance, "tokenizer": tok.name, "tokenizer_hash": tok.content_hash})
        tok.save(ckpt / "tokenizer.json")
        return _register(ckpt, cfg, provenance, name=name, aliases=aliases, workdir=workdir,
                         tracking_uri=tracking_uri, parameters=parameter_count(cfg))


def _register(ckpt: Path, cfg: Any, provenance: dict[str, Any], *, name: str | None, aliases: Sequence[str] | None,
              workdir: str | None, tracking_uri: str | None, parameters: int) -> dict[str, Any]:
    """An MLflow run in the experiment ``imports`` holding the checkpoint folder, registered as a version. The
    run is named after the family and the files' sha256: importing the same files again registers nothing new."""
    # lazy: keeps mlflow out of this module's import
    from mlflow.entities import Param
    from mlflow.exceptions import MlflowException

    wd = resolve_workdir(workdir)
    uri = tracking_uri or resolve_tracking_uri(wd)
    model_name = name or DEFAULT_MODEL_NAME
    c = client(uri)
    exp = ensure_experiment(EXPERIMENT, uri, wd)
    digest = "-".join(v[:12] for v in provenance["sha256"].values())
    run_id, created = find_or_create_run(uri, exp, f"import-{provenance['family']}-{digest}",
                                         tags={"imported_from": provenance["source"]})
    tags = training_tags(cfg, imported="true", source=provenance["source"], revision=provenance["revision"],
                         family=provenance["family"], license=provenance["license"],
                         reference=provenance["reference"], reference_commit=provenance["reference_commit"],
                         sha256=json.dumps(provenance["sha256"], sort_keys=True), ema=str(provenance["ema"]).lower())
    try:
        done = c.search_model_versions(f"name='{model_name}' and run_id='{run_id}'")
    except MlflowException:  # no such registered model yet
        done = []
    if done:  # the same files imported before: that version, nothing new (but the aliases asked for)
        mv = min(done, key=lambda v: int(v.version))
        log.info(f"{provenance['source']} is already imported as {model_name} v{mv.version}")
        for alias in aliases or ():
            c.set_registered_model_alias(model_name, alias, mv.version)
            log.info(f"alias {alias} now names {model_name} v{mv.version}")
    else:
        if created:
            c.log_batch(run_id, params=[Param(f"model.{k}", str(v)) for k, v in cfg.to_dict().items()])
        c.log_artifacts(run_id, str(ckpt), "checkpoint")
        mv = register_checkpoint(run_id, model_name, tags, tracking_uri=uri, checkpoint_dir=ckpt,
                                 aliases=tuple(aliases) if aliases else ("candidate",))
    c.set_terminated(run_id, "FINISHED")
    return {"name": model_name, "version": str(mv.version), "uri": f"models:/{model_name}/{mv.version}",
            "run_id": run_id, "kind": cfg.kind, "family": provenance["family"], "parameters": parameters,
            "tags": tags, "new": not done}
