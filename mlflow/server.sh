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
#   MLFLOW_AUTH_DB_URI                the users' store (default: sqlite beside the tracking store)
#   MLFLOW_FLASK_SERVER_SECRET_KEY_FILE  the auth app's CSRF key, one for all servers of a store (default: made
#                                     once in $ADLM_WORKDIR/mlflow-flask-secret)
#
# Secrets never reach a command line (`ps` shows it to every user) or the log: the store URI and the
# artifact destination go to mlflow through its environment variables, and what is printed is redacted.
set -euo pipefail

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

case "$MLFLOW_BACKEND_STORE_URI" in
  postgresql*) python - <<'PY' || { echo "mlflow/server.sh: PostgreSQL store needs psycopg2: pip install psycopg2-binary" >&2; exit 2; }
import psycopg2  # noqa: F401
PY
  ;;
esac

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
    cat > "$auth_ini" <<INI
[mlflow]
default_permission = READ
database_uri = ${MLFLOW_AUTH_DB_URI:-sqlite:///$workdir/mlflow-auth.db}
admin_username = ${MLFLOW_AUTH_ADMIN_USERNAME:-admin}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
INI
    export MLFLOW_AUTH_CONFIG_PATH="$auth_ini"
    args+=(--app-name basic-auth)
    auth="basic (admin ${MLFLOW_AUTH_ADMIN_USERNAME:-admin})"
    ;;
  *) echo "mlflow/server.sh: MLFLOW_AUTH=${MLFLOW_AUTH}: use basic or off" >&2; exit 2 ;;
esac

echo "mlflow/server.sh: store=$(echo "$MLFLOW_BACKEND_STORE_URI" | redact)" \
     "artifacts=$(echo "$MLFLOW_ARTIFACTS_DESTINATION" | redact) auth=$auth on http://$host:$port" >&2
exec mlflow server "${args[@]}"
