"""The MLflow model registry as the pipeline uses it.

Contract shared by training, tuning, evaluation and serving:

- Training logs its exported checkpoint folder (``adlm_model.interop.checkpoint`` layout: ``config.json``,
  ``model.safetensors``, ``ema.safetensors``, ``tokenizer.json``) as the run artifact ``checkpoint``.
- ``register_checkpoint`` turns it into an MLflow Model logged into that run (pyfunc, models-from-code:
  ``pipelines.tracking.mlflow_model``) and registers that model as a new version, with the run id, tags
  (``kind``, ``gamma``, ``tau``, ``data_manifest_hash``, ``val_ppl``, ``checkpoint_uri``, ...) and aliases
  (``candidate``, ``champion``); stages are never used. ``mlflow.pyfunc.load_model("models:/adlm@champion")``
  and ``mlflow models serve`` work on every version.
- ``resolve_model_ref(model)``: what every stage that takes ``--model`` (evaluation, serving, export, the
  lm-eval adapter) resolves a model reference with: ``models:/name@alias``, ``models:/name/3``, a checkpoint
  folder or a checkpoint in an object store, downloaded once into the node's cache (``ModelRef``).
- ``resolve_model(uri)`` accepts ``models:/name@alias``, ``models:/name/3`` or a local checkpoint
  directory and returns a local checkpoint directory to ``load_checkpoint`` from: for a version, the
  checkpoint folder inside its downloaded MLflow Model (or, for a version registered before versions
  were MLflow Models, the bare folder itself).
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.core.storage import download_dir, is_uri, node_cache_dir
from pipelines.tracking.runs import client, redact_uri, require_server, resolve_tracking_uri

DEFAULT_MODEL_NAME = "adlm"
CHECKPOINT_ARTIFACT = "checkpoint"


class RegistryError(ValueError):
    """A model URI, alias or version that the registry does not have."""


def training_tags(model_cfg: Any, **extra: Any) -> dict[str, Any]:
    """The tags every registered training checkpoint carries: its kind and, for the anchored kind only,
    gamma and tau (an MDLM, AR or BD3-LM version has no anchor loss to describe), plus ``extra``."""
    # lazy: keeps torch out of this module's import
    from adlm_model.kinds import model_kind

    tags: dict[str, Any] = {"kind": model_cfg.kind}
    if model_kind(model_cfg.kind).anchored:
        tags.update(gamma=model_cfg.gamma, tau=model_cfg.tau)
    return {**tags, **extra}


def register_checkpoint(run_id: str, name: str, tags: dict[str, Any], *, tracking_uri: str | None = None,
                        aliases: tuple[str, ...] = ("candidate",), artifact_path: str = CHECKPOINT_ARTIFACT,
                        checkpoint_dir: str | os.PathLike | None = None):
    """Log the run's checkpoint as an MLflow Model into the run and register it as a new version of ``name``
    with ``tags`` (plus ``checkpoint_uri``) and ``aliases``; returns the ModelVersion.

    The checkpoint is the run's artifact folder ``artifact_path``; ``checkpoint_dir``, a local copy of it,
    saves the download. A checkpoint that lacks a file raises RegistryError before anything is registered.
    """
    # lazy: keeps mlflow out of this module's import
    import mlflow
    from mlflow.exceptions import MlflowException

    # lazy: keeps torch out of this module's import
    from pipelines.tracking.mlflow_model import ModelPackagingError, log_text_model, using_tracking_uri
    uri = tracking_uri or resolve_tracking_uri()
    c = client(uri)
    source = c.get_run(run_id).info.artifact_uri.rstrip("/") + "/" + artifact_path
    with tempfile.TemporaryDirectory(prefix="adlm-register-") as tmp:
        local = Path(checkpoint_dir) if checkpoint_dir is not None else None
        if local is None:
            try:
                local = Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=artifact_path,
                                                                 dst_path=str(Path(tmp) / "download"),
                                                                 tracking_uri=uri))
            except (MlflowException, OSError) as e:  # a store error: say which artifact is missing
                raise RegistryError(f"run {run_id} has no artifact folder {artifact_path!r} to register "
                                    f"({type(e).__name__}); log the checkpoint first") from e
        try:
            info = log_text_model(run_id, local, uri, Path(tmp) / "staged")
        except ModelPackagingError as e:
            raise RegistryError(str(e)) from e
    try:
        c.get_registered_model(name)
    except MlflowException:  # RESOURCE_DOES_NOT_EXIST: create it
        try:
            c.create_registered_model(name, description="ADLM pipeline models: MLflow pyfunc models (text in, "
                                                        "text out) holding a safetensors checkpoint")
        except MlflowException as e:  # created concurrently; anything else fails the version's creation below
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
    # The version keeps the run id (evaluation and promotion read it) and links the logged model.
    with using_tracking_uri(uri):
        mv = c.create_model_version(name, source=info.model_uri, run_id=run_id, model_id=info.model_id,
                                    tags={k: str(v) for k, v in {**tags, "checkpoint_uri": source}.items()})
    for alias in aliases:
        c.set_registered_model_alias(name, alias, mv.version)
    return mv


# MLflow's documented rules for registered model names and aliases (docs: "Registered model aliases"), checked
# here rather than through MLflow's private validators, whose names change between releases (3.18 renamed them).
# tests/pipelines/test_registry_names.py holds these rules against what a real registry accepts and refuses.
ALIAS_PATTERN = re.compile(r"[\w\-]*")
VERSION_ALIAS = re.compile(r"[vV]\d+")
MAX_ALIAS_LENGTH = 255


def name_problem(name: str) -> str | None:
    """Why MLflow refuses ``name`` as a registered model name, or None: empty, ``/`` or ``:`` in it, or a path
    that normalises to another name (MLflow may store a name as a file path)."""
    if not name or not name.strip():
        return "Missing value for required parameter 'name'."
    if "/" in name or ":" in name:
        return f"Invalid model name '{name}'. Names cannot contain '/' or ':'."
    norm = posixpath.normpath(name)
    if norm != name or norm == "." or norm.startswith(".."):
        return f"Invalid model name '{name}': it would resolve to {norm!r} when treated as a file name."
    return None


def alias_problem(alias: str) -> str | None:
    """Why MLflow refuses ``alias`` as a registered model alias, or None: empty, characters other than
    alphanumerics, ``_`` and ``-``, over 255 characters, or reserved (``latest`` in any case, ``v<digits>``)."""
    if not alias:
        return "Registered model alias name cannot be empty."
    if not ALIAS_PATTERN.fullmatch(alias):
        return (f"Invalid alias name: '{alias}'. Names may only contain alphanumerics, underscores (_), "
                "and dashes (-).")
    if len(alias) > MAX_ALIAS_LENGTH:
        return f"Registered model alias name exceeds the maximum length of {MAX_ALIAS_LENGTH} characters."
    if alias.lower() == "latest":
        return "'latest' alias name (case insensitive) is reserved."
    if VERSION_ALIAS.fullmatch(alias):
        return f"Version alias name '{alias}' is reserved."
    return None


def check_names(name: str | None, aliases: Sequence[str] = ()) -> None:
    """RegistryError (one line) unless ``name`` is a registered model name and each of ``aliases`` an alias MLflow
    accepts: checked before any work, not found when the version is created (with its files already logged)."""
    problems = [("--name", name_problem(name))] if name is not None else []
    problems += [("--alias", alias_problem(a)) for a in aliases]
    for flag, problem in problems:
        if problem:
            raise RegistryError(f"{flag}: {problem[:200]}")


def registered_version(name: str, run_id: str, step: int, *, tracking_uri: str | None = None) -> Any:
    """The version already registered from training run ``run_id`` at ``step``, or None: what makes a rerun
    of a finished run (training, sweep, the whole pipeline) register nothing new and move no alias."""
    # lazy: keeps mlflow out of this module's import
    from mlflow.exceptions import MlflowException

    c = client(tracking_uri)
    try:
        versions = c.search_model_versions(f"name='{name}' and run_id='{run_id}'")
    except MlflowException:  # no such registered model yet
        return None
    same = [v for v in versions if (v.tags or {}).get("step") == str(step)]
    return min(same, key=lambda v: int(v.version)) if same else None


def register_once(run_id: str, name: str, step: int, tags: dict[str, Any], **kwargs: Any) -> tuple[Any, bool]:
    """The version of ``name`` registered from run ``run_id`` at ``step``: the one already there
    (``registered_version``: a rerun registers nothing new and moves no alias), else a new one from
    ``register_checkpoint(run_id, name, tags, **kwargs)``. Returns (the version, whether it is new)."""
    mv = registered_version(name, run_id, step, tracking_uri=kwargs.get("tracking_uri"))
    if mv is not None:
        return mv, False
    return register_checkpoint(run_id, name, tags, **kwargs), True


def parse_model_uri(uri: str) -> tuple[str, str | None, str | None]:
    """``models:/name@alias`` -> (name, None, alias); ``models:/name/3`` -> (name, "3", None)."""
    m = re.fullmatch(r"models:/([^/@]+)(?:@([\w\-.]+)|/(\d+))", uri)
    if not m:
        raise RegistryError(f"bad model URI {uri!r}: use models:/NAME@ALIAS, models:/NAME/VERSION or a checkpoint dir")
    return m.group(1), m.group(3), m.group(2)


def get_version(uri: str, tracking_uri: str | None = None):
    """The ModelVersion a ``models:/`` URI names, or a one-line RegistryError."""
    # lazy: keeps mlflow out of this module's import
    from mlflow.exceptions import MlflowException

    name, version, alias = parse_model_uri(uri)
    require_server(tracking_uri, f"reading {uri}")  # seconds, not MLflow's minutes of retries on a dead server
    c = client(tracking_uri)
    try:
        if alias is not None:
            return c.get_model_version_by_alias(name, alias)
        return c.get_model_version(name, version)
    except MlflowException:
        what = f"alias {alias!r}" if alias else f"version {version}"
        store = redact_uri(tracking_uri) if tracking_uri else "the tracking store"
        raise RegistryError(f"registered model {name!r} has no {what} in {store}{_what_exists(c, name)}: name one "
                            f"of those, or pass a checkpoint directory (the MLflow UI lists every model: mlflow ui "
                            f"--backend-store-uri TRACKING_URI)") from None


def _what_exists(c: Any, name: str) -> str:
    """`` (it has versions 1-3; aliases champion=2)`` or `` (no model of that name)``: what the message of a
    missing version offers instead (``mlflow models`` has no list command)."""
    # lazy: keeps mlflow out of this module's import
    from mlflow.exceptions import MlflowException

    try:
        versions = sorted(int(v.version) for v in c.search_model_versions(f"name='{name}'"))
        aliases = dict(getattr(c.get_registered_model(name), "aliases", None) or {})
    except MlflowException:
        return " (no registered model of that name)"
    if not versions:
        return " (it has no versions)"
    said = ", ".join(map(str, versions)) if len(versions) <= 6 else f"{versions[0]}-{versions[-1]}"
    alias_text = ", ".join(f"{a}={v}" for a, v in sorted(aliases.items()))
    return f" (it has versions {said}" + (f"; aliases {alias_text})" if alias_text else ")")


def download_version(uri: str, tracking_uri: str | None = None, dst: str | os.PathLike | None = None) -> Path:
    """Download the files of the version a ``models:/`` URI names; returns the local folder (an MLflow Model,
    or a bare checkpoint folder for a version registered before versions were MLflow Models)."""
    # lazy: keeps mlflow out of this module's import
    import mlflow
    from mlflow.exceptions import MlflowException

    mv = get_version(uri, tracking_uri)
    location = client(tracking_uri).get_model_version_download_uri(mv.name, mv.version)
    try:
        local = mlflow.artifacts.download_artifacts(artifact_uri=location, dst_path=str(dst) if dst else None,
                                                    tracking_uri=tracking_uri)
    except (MlflowException, OSError):  # the registry has the version, the artifact store not its files
        raise RegistryError(f"{uri}: the registry has version {mv.version} of {mv.name} but its files cannot be "
                            f"downloaded from {redact_uri(str(location))} (deleted or unreachable); register the "
                            "model again from its run or checkpoint") from None
    return Path(local)


def checkpoint_of(local: str | os.PathLike) -> Path:
    """The checkpoint folder of a downloaded version (``download_version``), or RegistryError."""
    # lazy: keeps torch out of this module's import
    from pipelines.tracking.mlflow_model import checkpoint_in_model

    root = Path(local)
    inner = checkpoint_in_model(root)
    if inner is not None and (inner / "config.json").is_file():
        return inner
    if (root / "config.json").is_file():
        return root
    raise RegistryError(f"{root} holds neither an MLflow Model with a checkpoint artifact nor a checkpoint "
                        "(config.json): re-register the model from its training run")


def resolve_model(uri: str, tracking_uri: str | None = None, dst: str | os.PathLike | None = None) -> Path:
    """A local checkpoint directory for a registry URI or a path."""
    if not uri.startswith("models:/"):
        p = Path(uri).expanduser()
        if not (p / "config.json").is_file():
            raise RegistryError(f"{uri} is neither a models:/ URI nor a checkpoint directory with config.json")
        return p
    return checkpoint_of(download_version(uri, tracking_uri, dst))


# ----------------------------------------------------------------------------------------------------------
# Model references: what ``--model`` names, resolved to a local checkpoint folder on this node.


@dataclass
class ModelRef:
    """What ``--model`` named: a URI and the local checkpoint directory it resolves to."""

    uri: str
    local_dir: str
    name: str | None = None
    version: str | None = None
    run_id: str | None = None
    """Training run of a registered version."""

    @property
    def pinned(self) -> str:
        """The URI that names exactly this model on any node: ``models:/NAME/VERSION`` (an alias could move
        while an evaluation runs) or the checkpoint location as given."""
        return f"models:/{self.name}/{self.version}" if self.version else self.uri


def resolve_model_ref(model: str, tracking_uri: str | None, cache: str | os.PathLike | None = None) -> ModelRef:
    """A local folder of ``model`` on this node: a ``models:/`` URI or a checkpoint in an object store is
    downloaded once into the node's cache (``cache``, default ``storage.node_cache_dir()``); a local checkpoint
    folder is used as it is. Every node resolves for itself: the driver plans with it, and each evaluation
    task loads its model with it where it runs. A registered version is an MLflow Model whose checkpoint is a
    folder inside it (``checkpoint_of``)."""
    # No cache given (a task of a remote work directory, a caller without one): this node's own cache.
    models = Path(cache) / "models" if cache else node_cache_dir("models")
    if is_uri(model):
        dst = models / ("ckpt-" + hashlib.sha256(model.encode()).hexdigest()[:16])
        if not (dst / "config.json").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=".ckpt-", dir=models))
            try:
                download_dir(model, tmp)
                if not (tmp / "config.json").is_file():
                    raise RegistryError(f"{model} is not a checkpoint: no config.json (pass a checkpoint folder or "
                                        "a models:/ URI)")
                _settle(tmp, dst)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return ModelRef(uri=model, local_dir=str(dst))
    if not model.startswith("models:/"):
        return ModelRef(uri=model, local_dir=str(resolve_model(model, tracking_uri)))
    mv = get_version(model, tracking_uri)

    def cached() -> Path | None:
        try:
            return checkpoint_of(dst) if dst.is_dir() else None
        except RegistryError:
            return None

    # Keyed by the version's identity, not only its number: the cache (ADLM_CACHE) may be shared by several
    # tracking stores, and a recreated registry numbers its versions from 1 again.
    ident = hashlib.sha256(f"{tracking_uri}|{mv.source}|{mv.run_id}".encode()).hexdigest()[:12]
    dst = models / f"{mv.name}-v{mv.version}-{ident}"
    if cached() is None:
        uri = f"models:/{mv.name}/{mv.version}"
        # Downloaded beside its final place, so the rename is atomic (same filesystem) and nothing is left in /tmp.
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{mv.name}-v{mv.version}-", dir=dst.parent))
        try:
            local = download_version(uri, tracking_uri, dst=tmp)
            checkpoint_of(local)  # a version without a checkpoint fails here, not as a half-filled cache entry
            try:
                os.replace(local, dst)
            except OSError:
                if cached() is None:  # not a concurrent download that won: a real failure
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return ModelRef(uri=model, local_dir=str(checkpoint_of(dst)), name=mv.name, version=str(mv.version),
                    run_id=mv.run_id)


def _settle(local: str | os.PathLike, dst: Path) -> None:
    """Move a downloaded folder into its cache entry (same filesystem: atomic); a concurrent download that
    won is fine, any other failure is raised."""
    try:
        os.replace(local, dst)
    except OSError:
        if not (dst / "config.json").is_file():
            raise
