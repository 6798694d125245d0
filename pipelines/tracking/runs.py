"""MLflow tracking that never stops training.

- ``resolve_tracking_uri``: env ``MLFLOW_TRACKING_URI`` > ``sqlite:///<workdir>/mlflow.db``; artifacts of
  the experiments created here go to ``<workdir>/mlartifacts`` unless the server decides.
- ``client``: the one way the pipeline makes an ``MlflowClient`` (tracking and registry on one URI).
- ``find_or_create_run``: one MLflow run per training run name. The run id is fixed when the run
  starts, stored in every checkpoint (meta ``mlflow_run_id``) and reopened on resume, so that a
  resumed or restarted run keeps logging into the same run.
- ``pipelines.tracking.spool``: rank 0's asynchronous metric logger and the run's spool, which a tracking outage of any
  length leaves training with.
- ``tracking_reachable``: a quick probe of a tracking server before the first (retrying) MLflow call. A
  server that refuses this client's credentials (401/403) is not an outage: ``TrackingAuthError``, one line
  naming what to set, before any training (an outage, by contrast, leaves training going and the spool).
- ``check_tracking_uri``: a tracking URI of a scheme MLflow has no store for, or an sqlite file that is no
  database, is refused in one line (``TrackingConfigError``) before the first MLflow call; ``require_server``: a
  command that cannot do its work without the store (evaluation, import, reading a ``models:/`` version) refuses
  a server that does not answer in seconds (``TrackingUnavailableError``), where MLflow would retry for minutes.
  Training, sweeps and studies go on through an outage instead (the spool; ``best_effort``).
- ``best_effort``: the one way a command makes MLflow calls that a tracking outage must not stop (a run's
  bookkeeping, a sweep's or a study's parent run): an outage is one warning saying what goes on without
  MLflow; refused credentials are said as such (``TrackingAuthError`` before the work, a warning after it).
- ``plot_loss_curve``: the loss-curve artifact, drawn from the run's stored metric history.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

from pipelines.core.logs import first_line, get_logger
from pipelines.core.storage import StorageError, is_uri, join, resolve_workdir

log = get_logger("tracking")  # has a handler in a Ray worker too (the metric sender runs there)

RUN_NAME_TAG = "adlm.run_name"


def resolve_tracking_uri(workdir: str | os.PathLike | None = None) -> str:
    """``$MLFLOW_TRACKING_URI``, else a sqlite store in a local work directory. A remote work directory (a
    cluster) needs a tracking server: a sqlite file cannot live in an object store."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    wd = resolve_workdir(workdir)
    if is_uri(wd):
        raise StorageError(f"the work directory {wd} is remote: set MLFLOW_TRACKING_URI to a tracking server "
                           "(mlflow/server.sh) that every node reaches")
    return f"sqlite:///{Path(wd) / 'mlflow.db'}"


_USERINFO = re.compile(r"(?<=://)([^/@:]*):([^/@]*)@")
_SECRET_QUERY = re.compile(r"(?i)([?&](?:password|passwd|pwd|token|secret|access_key|key)=)[^&]*")


def redact_uri(uri: str | None) -> str:
    """``uri`` with its password (``scheme://user:password@host``) and secret query values replaced by
    ``***``: what every message, log line and summary shows of a tracking or store URI (a job's logs are
    readable by everyone on the cluster's dashboard)."""
    if not uri:
        return str(uri)
    return _SECRET_QUERY.sub(r"\1***", _USERINFO.sub(r"\1:***@", str(uri)))


STORE_SCHEMES = ("http", "https", "sqlite", "file", "postgresql", "mysql", "mssql", "databricks", "databricks-uc",
                 "uc")
"""The schemes MLflow has a tracking store for (``postgresql+psycopg2://`` is ``postgresql``)."""
SQLITE_HEADER = b"SQLite format 3\x00"


class TrackingConfigError(ValueError):
    """A tracking URI no store can be made of (an unknown scheme, an sqlite file that is no database)."""

    exit_code = 2  # bad input, found before any work (pipelines.core.cli)


_checked: set[str] = set()


def check_tracking_uri(uri: str) -> None:
    """Refuse, in one line, a tracking URI of a scheme MLflow has no store for or an sqlite file that is not a
    database (MLflow's own errors: a 90-line traceback, or minutes of retries). A URI found good is not read again."""
    if uri in _checked:
        return
    shown = redact_uri(uri)
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else ("sqlite" if uri.startswith("sqlite:") else "file")
    if scheme.split("+", 1)[0] not in STORE_SCHEMES:
        raise TrackingConfigError(
            f"tracking URI {shown}: MLflow has no store for the scheme {scheme!r}; use a tracking server "
            "(http://HOST:PORT, https://...), sqlite:///PATH.db or postgresql://... (MLFLOW_TRACKING_URI / "
            "--tracking-uri)")
    if scheme == "file" and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("1", "true", "yes"):
        raise TrackingConfigError(
            f"tracking URI {shown} is a folder store, which MLflow no longer opens by default: use sqlite:///PATH.db "
            "or a tracking server (or set MLFLOW_ALLOW_FILE_STORE=true to open it anyway)")
    if scheme == "sqlite" and uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):].split("?", 1)[0])
        if path.is_dir():
            raise TrackingConfigError(f"tracking URI {shown}: {path} is a folder, not an SQLite database file")
        if path.is_file() and path.stat().st_size:
            with path.open("rb") as f:
                head = f.read(len(SQLITE_HEADER))
            if head != SQLITE_HEADER:
                raise TrackingConfigError(f"tracking URI {shown}: {path} is not an SQLite database; point the URI "
                                          "at the tracking store's .db file, or at a new file to start one")
    _checked.add(uri)


def client(tracking_uri: str | None) -> Any:
    """An ``MlflowClient`` whose tracking and registry URIs are both ``tracking_uri`` (checked:
    ``check_tracking_uri``)."""
    # lazy: keeps mlflow out of this module's import
    import mlflow

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        check_tracking_uri(uri)

    return mlflow.MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def ensure_experiment(name: str, tracking_uri: str, workdir: str | os.PathLike | None = None) -> str:
    """Create (or find) an MLflow experiment; local stores get an explicit artifact location."""
    c = client(tracking_uri)
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    artifact_location = None
    if tracking_uri.startswith("sqlite:") or tracking_uri.startswith("file:"):
        # A local store names its artifact location; a server decides its own (--artifacts-destination).
        wd = resolve_workdir(workdir)
        artifact_location = join(wd, "mlartifacts") if is_uri(wd) else (Path(wd) / "mlartifacts").as_uri()
    # lazy: keeps mlflow out of this module's import
    from mlflow.exceptions import MlflowException

    try:
        return c.create_experiment(name, artifact_location=artifact_location)
    except MlflowException:  # created concurrently (another trial, another node): take that one
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def find_or_create_run(tracking_uri: str, experiment_id: str, run_name: str, *, run_id: str | None = None,
                       tags: dict[str, str] | None = None, parent_run_id: str | None = None) -> tuple[str, bool]:
    """(run id, created). ``run_id`` (from a checkpoint) wins; else the run tagged with this name."""
    # lazy: keeps mlflow out of this module's import
    from mlflow.exceptions import MlflowException

    c = client(tracking_uri)
    if run_id:
        try:
            c.get_run(run_id)
            c.update_run(run_id, status="RUNNING")
            return run_id, False
        except MlflowException:  # RESOURCE_DOES_NOT_EXIST: the store was reset: fall back to lookup / create
            log.warning("MLflow run %s from the checkpoint is not in %s; looking it up by name", run_id, tracking_uri)
    found = c.search_runs([experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'",
                               max_results=1, order_by=["attributes.start_time DESC"])
    if found:
        rid = found[0].info.run_id
        c.update_run(rid, status="RUNNING")
        return rid, False
    all_tags = {RUN_NAME_TAG: run_name, **(tags or {})}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    run = c.create_run(experiment_id, run_name=run_name, tags=all_tags)
    return run.info.run_id, True


def log_params_once(tracking_uri: str, run_id: str, params: dict[str, Any]) -> None:
    """Log params that the run does not have yet (MLflow params are immutable); changed values of a
    resumed run (e.g. a longer max_steps) go to tags ``resumed.<key>``."""
    # lazy: keeps mlflow out of this module's import
    from mlflow.entities import Param, RunTag

    c = client(tracking_uri)
    have = c.get_run(run_id).data.params
    new = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in have]
    changed = [RunTag(f"resumed.{k}", str(v)[:5000]) for k, v in params.items() if k in have and have[k] != str(v)[:6000]]
    for i in range(0, len(new), 100):
        c.log_batch(run_id, params=new[i:i + 100])
    for i in range(0, len(changed), 100):
        c.log_batch(run_id, tags=changed[i:i + 100])


class TrackingAuthError(ValueError):
    """The tracking server refused this client's credentials (HTTP 401/403): a setting to fix, not an outage."""


AUTH_HINT = ("set MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in this "
             "process's environment, or ~/.mlflow/credentials on the node (cluster.yaml fetches it from the "
             "Secrets Manager secret adlm/mlflow-credentials)")

_PROBE = "/api/2.0/mlflow/experiments/get-by-name"
"""An authenticated route of the tracking API (``/health`` answers anyone, so it cannot tell a refused
credential); the experiment need not exist: 404 means the server took the credentials."""


def _auth_headers_and_basic(tracking_uri: str) -> tuple[dict[str, str], tuple[str, str] | None]:
    """The credentials MLflow's own client would send to ``tracking_uri``: a bearer token, else basic auth
    from the environment or ``~/.mlflow/credentials``."""
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    if token:
        return {"Authorization": f"Bearer {token}"}, None
    try:
        # lazy: keeps mlflow out of this module's import; a release without it falls back to the environment
        from mlflow.utils.credentials import read_mlflow_creds

        creds = read_mlflow_creds()
        if creds.username and creds.password:
            return {}, (creds.username, creds.password)
    except (ImportError, AttributeError, OSError, ValueError):  # another MLflow, an unreadable file: the environment
        user, pw = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
        if user and pw:
            return {}, (user, pw)
    return {}, None


def tracking_reachable(tracking_uri: str, timeout: float = 5.0) -> bool:
    """Whether a tracking server answers within ``timeout`` (local stores: always). A quick probe before the
    first MLflow call: MLflow's own retries would wait about 4 minutes on a dead server. Connection refused, a
    timeout or a 5xx is an outage (False); a 401/403 raises ``TrackingAuthError``: no retry fixes it. A URI no store
    can be made of raises ``TrackingConfigError`` (``check_tracking_uri``)."""
    return probe(tracking_uri, timeout) is None


def probe(tracking_uri: str, timeout: float = 5.0) -> str | None:
    """``tracking_reachable``'s probe: None when the store answers, else why not (``connection refused``, ``no
    answer within 5 s``, ``HTTP 503``)."""
    check_tracking_uri(tracking_uri)
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    # lazy: keeps requests out of this module's import
    import requests

    headers, basic = _auth_headers_and_basic(tracking_uri)
    try:
        r = requests.get(tracking_uri.rstrip("/") + _PROBE, params={"experiment_name": "Default"},
                         headers=headers, auth=basic, timeout=timeout)
    except requests.Timeout:
        return f"no answer within {timeout:g} s"
    except requests.ConnectionError as e:
        return "connection refused" if "refused" in str(e).lower() else f"cannot connect: {first_line(e, 120)}"
    except requests.RequestException as e:
        return first_line(e, 120)
    if r.status_code in (401, 403):
        raise TrackingAuthError(f"the MLflow tracking server at {redact_uri(tracking_uri)} refused this client's "
                                f"credentials (HTTP {r.status_code}): {AUTH_HINT}")
    return f"HTTP {r.status_code}" if r.status_code >= 500 else None


def is_auth_refusal(e: BaseException) -> bool:
    """Whether an MLflow client error is the server refusing the credentials (401/403, UNAUTHENTICATED,
    PERMISSION_DENIED) rather than an outage."""
    code = str(getattr(e, "error_code", "") or "")
    status = getattr(getattr(e, "response", None), "status_code", None) or getattr(e, "get_http_status_code",
                                                                                  lambda: None)()
    return (code in ("UNAUTHENTICATED", "PERMISSION_DENIED") or status in (401, 403)
            or bool(re.search(r"error code 40[13]\b", str(e))))


class TrackingUnavailable(RuntimeError):
    """The tracking server gave no answer to the quick probe (``require_tracking``): an outage."""


def require_tracking(tracking_uri: str, timeout: float = 5.0) -> None:
    """``tracking_reachable`` as the first call of a ``best_effort`` block: a server that does not answer raises
    ``TrackingUnavailable`` (an outage, so the block is skipped at once instead of in MLflow's 4 minutes of
    retries); one that refuses the credentials raises ``TrackingAuthError``."""
    if not tracking_reachable(tracking_uri, timeout=timeout):
        raise TrackingUnavailable(f"no answer within {timeout:g} s")


class TrackingUnavailableError(ValueError):
    """A command that needs the tracking store to do anything, started against a server that does not answer."""

    exit_code = 2  # nothing was done (pipelines.core.cli)


def require_server(tracking_uri: str | None, what: str, timeout: float = 5.0) -> None:
    """Before a command whose work needs the tracking store (``what``: reading a registered version, logging an
    evaluation, importing): a server that does not answer within ``timeout`` seconds is refused in one line
    (``TrackingUnavailableError``), not waited on through MLflow's minutes of retries; refused credentials raise
    ``TrackingAuthError``; a bad URI ``TrackingConfigError``. Local stores need no server."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return
    why = probe(uri, timeout=timeout)
    if why is not None:
        raise TrackingUnavailableError(
            f"no tracking server at {redact_uri(uri)} ({why}), and {what} needs one: start it (mlflow/server.sh) or "
            "point MLFLOW_TRACKING_URI (or --tracking-uri) at one that answers")


class best_effort:
    """A block of MLflow calls that a tracking outage must not stop (what the command does goes on without them):

        with best_effort(uri, "sweeping without a parent run") as t:
            require_tracking(uri)
            ...
        if t.failed: ...

    - an outage (no answer, a 5xx, MLflow's retries run out, any other error of the store) leaves the block with
      one warning, ``MLflow at <uri> is unavailable (<first line of the error>); <without>``, and ``failed`` set;
    - a server that refuses this client's credentials (HTTP 401/403, ``UNAUTHENTICATED``) is not an outage: no
      retry fixes it. With ``stop_on_refusal`` (before the work: nothing is lost) ``TrackingAuthError`` names what
      to set and stops the command; without it (after the work: its results are kept) the warning says so;
    - ``without=None``: no warning (the caller says what follows), the reason at debug level.
    """

    def __init__(self, tracking_uri: str, without: str | None, *, stop_on_refusal: bool = True) -> None:
        self.tracking_uri, self.without, self.stop_on_refusal = tracking_uri, without, stop_on_refusal
        self.failed = False
        self.refused = False

    def __enter__(self) -> best_effort:
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: Any) -> bool:
        if e is None or not isinstance(e, Exception) or isinstance(e, TrackingConfigError):
            return False  # success, KeyboardInterrupt / SystemExit, or a URI no store can be made of: not an outage
        self.failed = True
        where = f"MLflow at {redact_uri(self.tracking_uri)}"
        if isinstance(e, TrackingAuthError) or is_auth_refusal(e):
            self.refused = True
            what = str(e) if isinstance(e, TrackingAuthError) else (
                f"the MLflow tracking server at {redact_uri(self.tracking_uri)} refused this client's credentials "
                f"({first_line(e)}): {AUTH_HINT}")
            if self.stop_on_refusal:
                raise TrackingAuthError(what) from None
            log.warning(what + (f"; {self.without}" if self.without else ""))
            return True
        if self.without is None:
            log.debug(f"{where} is unavailable ({first_line(e)})")
        else:
            log.warning(f"{where} is unavailable ({first_line(e)}); {self.without}")
        return True


def metric_history(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    hist = client(tracking_uri).get_metric_history(run_id, key)
    return sorted((m.step, m.value) for m in hist)


def plot_loss_curve(tracking_uri: str, run_id: str, out: str | os.PathLike) -> Path | None:
    """PNG of training loss / NLL and validation PPL against steps from the stored history."""
    # lazy: keeps matplotlib out of this module's import
    import matplotlib

    matplotlib.use("Agg")
    # lazy: keeps matplotlib out of this module's import
    import matplotlib.pyplot as plt

    series = {k: metric_history(tracking_uri, run_id, k) for k in ("train/loss", "train/nll", "val/ppl")}
    if not any(series.values()):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for k in ("train/loss", "train/nll"):
        if series[k]:
            s, v = zip(*series[k], strict=True)
            axes[0].plot(s, v, label=k)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("per-token loss (nats)")
    axes[0].legend()
    axes[0].set_title("training")
    if series["val/ppl"]:
        s, v = zip(*series["val/ppl"], strict=True)
        axes[1].plot(s, v, "o-", color="C2")
        axes[1].set_yscale("log")
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("validation PPL bound (EMA)")
    axes[1].set_title("validation")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def log_artifact_safely(tracking_uri: str, run_id: str, local: str | os.PathLike, artifact_path: str | None = None) -> bool:
    """Log a file or folder to the run; False (and a warning) when the store is out or refuses: an artifact must
    not fail the run, the caller decides what follows."""
    with best_effort(tracking_uri, f"{local} is not logged to run {run_id}", stop_on_refusal=False) as t:
        c = client(tracking_uri)
        if Path(local).is_dir():
            c.log_artifacts(run_id, str(local), artifact_path)
        else:
            c.log_artifact(run_id, str(local), artifact_path)
    return not t.failed


def temp_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="adlm-"))
