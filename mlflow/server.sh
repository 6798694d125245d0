#!/usr/bin/env bash
# The MLflow tracking server for the ADLM pipeline.
#
# One machine (default): sqlite store and local artifacts under $ADLM_WORKDIR (./work), bound to loopback:
#   mlflow/server.sh
# A cluster: PostgreSQL store, object-store artifacts, basic authentication, the cluster's host names:
#   MLFLOW_BACKEND_STORE_URI=postgresql://user:pass@db:5432/mlflow \
#   MLFLOW_ARTIFACTS_DESTINATION=s3://your-bucket/mlflow-artifacts \
#   MLFLOW_AUTH=basic MLFLOW_AUTH_ADMIN_PASSWORD_FILE=/run/secrets/mlflow_admin_password \
#   MLFLOW_HOST=0.0.0.0 MLFLOW_ALLOWED_HOSTS="mlflow.internal:*" mlflow/server.sh
# After an MLflow upgrade, back the store up, then upgrade its schema once (the server refuses an older one):
#   MLFLOW_BACKEND_STORE_URI=postgresql://user:pass@db:5432/mlflow mlflow/server.sh upgrade
# Jobs then point at it with MLFLOW_TRACKING_URI=http://<host>:<port> (and, with basic authentication, the
# node's MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, never a job's runtime env).
#
# Environment:
#   MLFLOW_HOST                       bind address (default 127.0.0.1)
#   MLFLOW_PORT                       port (default 5000)
#   MLFLOW_BACKEND_STORE_URI          default sqlite:///$ADLM_WORKDIR/mlflow-server.db
#   MLFLOW_ARTIFACTS_DESTINATION      default $ADLM_WORKDIR/mlartifacts-server (served through the server)
#   MLFLOW_WORKERS                    server workers (default 1)
#   MLFLOW_ALLOWED_HOSTS              Host headers the server answers (default: localhost and private addresses)
#   MLFLOW_AUTH                       "basic": MLflow's basic-auth app (users, permissions; default: off)
#   MLFLOW_AUTH_ADMIN_PASSWORD_FILE   a file holding the first admin's password (or MLFLOW_AUTH_ADMIN_PASSWORD)
#   MLFLOW_AUTH_DB_URI                the users' store (default: sqlite beside the tracking store; several servers
#                                     of one store share a database one: postgresql://...)
#   MLFLOW_AUTH_CACHE_TTL_S           how long a server trusts a checked password (default 60; 0: check every
#                                     request, about 0.1 CPU-second each: MLflow hashes passwords with scrypt). A
#                                     password changed through another server of the store stays valid that long
#   MLFLOW_FLASK_SERVER_SECRET_KEY_FILE  the auth app's CSRF key, one for all servers of a store (default: made
#                                     once in $ADLM_WORKDIR/mlflow-flask-secret)
#
# Secrets never reach a command line (`ps` shows it to every user) or the log: the store URI and the
# artifact destination go to mlflow through its environment variables, and what is printed is redacted.
set -euo pipefail

mode=serve
case "${1:-}" in
  "") ;;
  upgrade) mode=upgrade ;;
  *) echo "mlflow/server.sh: unknown argument '$1': run it without arguments to serve, or 'upgrade' to upgrade the store's schema" >&2; exit 2 ;;
esac

workdir="${ADLM_WORKDIR:-$(pwd)/work}"
case "$workdir" in *://*) workdir="$(pwd)/work" ;; esac  # the server's own files are local
mkdir -p "$workdir"
host="${MLFLOW_HOST:-127.0.0.1}"
port="${MLFLOW_PORT:-5000}"
export MLFLOW_BACKEND_STORE_URI="${MLFLOW_BACKEND_STORE_URI:-sqlite:///$workdir/mlflow-server.db}"
export MLFLOW_ARTIFACTS_DESTINATION="${MLFLOW_ARTIFACTS_DESTINATION:-$workdir/mlartifacts-server}"
workers="${MLFLOW_WORKERS:-1}"

# The job-execution workers of MLflow 3 cost ~1.2 GB and are not used by the pipeline.
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION="${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}"
export MLFLOW_DISABLE_TELEMETRY="${MLFLOW_DISABLE_TELEMETRY:-true}"

redact() { sed -E 's#(://[^:/@]+):[^@]*@#\1:***@#'; }

args=(--serve-artifacts --host "$host" --port "$port" --workers "$workers")
if [ -n "${MLFLOW_ALLOWED_HOSTS:-}" ]; then
  args+=(--allowed-hosts "$MLFLOW_ALLOWED_HOSTS")
fi

auth="off"
case "${MLFLOW_AUTH:-}" in
  "" | off) ;;
  basic)
    if [ -n "${MLFLOW_AUTH_ADMIN_PASSWORD_FILE:-}" ]; then
      [ -r "$MLFLOW_AUTH_ADMIN_PASSWORD_FILE" ] || {
        echo "mlflow/server.sh: MLFLOW_AUTH_ADMIN_PASSWORD_FILE=$MLFLOW_AUTH_ADMIN_PASSWORD_FILE is not readable" >&2; exit 2; }
      MLFLOW_AUTH_ADMIN_PASSWORD="$(cat "$MLFLOW_AUTH_ADMIN_PASSWORD_FILE")"
      export MLFLOW_AUTH_ADMIN_PASSWORD
    fi
    [ -n "${MLFLOW_AUTH_ADMIN_PASSWORD:-}" ] || {
      echo "mlflow/server.sh: MLFLOW_AUTH=basic needs the first admin's password: MLFLOW_AUTH_ADMIN_PASSWORD_FILE=<file>" >&2; exit 2; }
    auth_ini="$workdir/mlflow-auth.ini"
    umask 077
    # The CSRF key of the auth app: shared by every server of one store (a file they all read), else made once.
    if [ -z "${MLFLOW_FLASK_SERVER_SECRET_KEY:-}" ]; then
      key_file="${MLFLOW_FLASK_SERVER_SECRET_KEY_FILE:-$workdir/mlflow-flask-secret}"
      [ -s "$key_file" ] || python -c "import secrets; print(secrets.token_hex(32))" > "$key_file"
      MLFLOW_FLASK_SERVER_SECRET_KEY="$(cat "$key_file")"
      export MLFLOW_FLASK_SERVER_SECRET_KEY
    fi
    auth_db="${MLFLOW_AUTH_DB_URI:-sqlite:///$workdir/mlflow-auth.db}"
    [[ "${MLFLOW_AUTH_CACHE_TTL_S:-60}" =~ ^[0-9]+$ ]] || {
      echo "mlflow/server.sh: MLFLOW_AUTH_CACHE_TTL_S=${MLFLOW_AUTH_CACHE_TTL_S}: a whole number of seconds (0: no cache)" >&2; exit 2; }
    cat > "$auth_ini" <<INI
[mlflow]
default_permission = READ
database_uri = $auth_db
admin_username = ${MLFLOW_AUTH_ADMIN_USERNAME:-admin}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
auth_cache_ttl_seconds = ${MLFLOW_AUTH_CACHE_TTL_S:-60}
INI
    export MLFLOW_AUTH_CONFIG_PATH="$auth_ini"
    args+=(--app-name basic-auth)
    auth="basic (admin ${MLFLOW_AUTH_ADMIN_USERNAME:-admin})"
    ;;
  *) echo "mlflow/server.sh: MLFLOW_AUTH=${MLFLOW_AUTH}: use basic or off" >&2; exit 2 ;;
esac

# Before the server starts (or instead of it: upgrade), in one Python process, without the URIs on a command line:
# - the database driver each store's URI needs: SQLAlchemy picks it from the scheme (postgresql:// is psycopg 3 from
#   SQLAlchemy 2.1 on, postgresql+psycopg2:// psycopg2, mysql:// mysqlclient);
# - serve: a store whose schema is older than this MLflow's (MLflow refuses it) stops here in one line naming the
#   upgrade; a store that does not answer yet is left to MLflow, which retries the connection;
# - upgrade: what `mlflow db upgrade <uri>` does (an empty database gets the whole schema), then exit.
command -v mlflow >/dev/null || {
  echo "mlflow/server.sh: no mlflow command on PATH: activate the project's environment (pip install -c requirements.lock -e '.[server]')" >&2
  exit 2; }
py="$(dirname "$(command -v mlflow)")/python"  # the interpreter of that mlflow, whatever python is first on PATH
[ -x "$py" ] || py=python
ADLM_SERVER_MODE="$mode" ADLM_AUTH_DB_URI="${auth_db:-}" "$py" - <<'PY' || exit 2
import glob, os, re, sys

from sqlalchemy.engine import make_url

mode, store, auth = os.environ["ADLM_SERVER_MODE"], os.environ["MLFLOW_BACKEND_STORE_URI"], os.environ["ADLM_AUTH_DB_URI"]
me = "mlflow/server.sh" + (" upgrade" if mode == "upgrade" else "")
is_db = lambda uri: "://" in uri and not uri.startswith("file:")  # noqa: E731
for what, uri in (("the store", store), ("the users' store", auth)):
    if uri and is_db(uri):
        scheme = uri.split("://", 1)[0]
        try:
            url = make_url(uri)
            url.get_dialect().import_dbapi()
        except ImportError as e:
            fix = "pip install -c requirements.lock -e '.[server]'" if scheme.startswith("postgresql") else "install it"
            sys.exit(f"{me}: {what} ({scheme}://) needs the Python module {e.name!r}: {fix}")
        except Exception as e:  # noqa: BLE001 - never a traceback (nor the URI, which holds a password)
            sys.exit(f"{me}: {what}'s URI ({scheme}://...) is not a database URI SQLAlchemy can use ({type(e).__name__})")
if not is_db(store):
    if mode == "upgrade":
        sys.exit(f"{me}: the store is a folder of files, which has no schema to upgrade")
    sys.exit(0)


def version(engine):
    import sqlalchemy

    with engine.connect() as c:
        if not sqlalchemy.inspect(c).has_table("alembic_version"):
            return None
        return c.execute(sqlalchemy.text("SELECT version_num FROM alembic_version")).scalar()


if mode == "upgrade":
    import mlflow.store.db.utils as dbu
    from mlflow.db import upgrade

    try:
        engine = dbu.create_sqlalchemy_engine_with_retry(store)
        before = version(engine)
        upgrade.main([store], standalone_mode=False)  # `mlflow db upgrade`, its URI never on a command line
    except Exception as e:  # noqa: BLE001 - one line, not a traceback
        sys.exit(f"{me}: failed ({type(e).__name__}: {str(e).strip().splitlines()[0][:300]}); a migration stopped "
                 "midway leaves the database as it was then: restore the backup before serving it")
    print(f"{me}: the store's schema {before or '(empty)'} -> {version(engine)}", file=sys.stderr)
    sys.exit(0)
# This MLflow's newest schema, read from its migration scripts' text (loading them imports all of MLflow: seconds).
import importlib.util

scripts = os.path.join(importlib.util.find_spec("mlflow").submodule_search_locations[0], "store", "db_migrations",
                       "versions", "*.py")
revisions, parents = set(), set()
for path in glob.glob(scripts):
    text = open(path).read()
    rev, down = re.search(r"^revision\s*=\s*(.+)$", text, re.M), re.search(r"^down_revision\s*=\s*(.+)$", text, re.M)
    if rev:
        revisions |= set(re.findall(r"[\"']([0-9a-f]+)[\"']", rev.group(1)))
    if down:
        parents |= set(re.findall(r"[\"']([0-9a-f]+)[\"']", down.group(1)))
heads = revisions - parents
try:
    import sqlalchemy

    found = version(sqlalchemy.create_engine(store, connect_args={"connect_timeout": 5} if store.startswith("postgres") else {}))
except Exception:  # noqa: BLE001 - not answering yet: MLflow itself retries and says why
    sys.exit(0)
if found is not None and len(heads) == 1 and found not in heads and found in revisions:
    sys.exit(f"{me}: the store's schema ({found}) is older than this MLflow's ({heads.pop()}): back the database up, "
             "then run `mlflow/server.sh upgrade` with the same environment, once")
PY
[ "$mode" = serve ] || exit 0

echo "mlflow/server.sh: store=$(echo "$MLFLOW_BACKEND_STORE_URI" | redact)" \
     "artifacts=$(echo "$MLFLOW_ARTIFACTS_DESTINATION" | redact) auth=$auth on http://$host:$port" >&2
exec mlflow server "${args[@]}"
