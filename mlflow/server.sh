#!/usr/bin/env bash
# The MLflow tracking server for the ADLM pipeline.
#
# One machine (default): sqlite store and local artifacts under $ADLM_WORKDIR (./work), bound to
# loopback:
#   mlflow/server.sh
# A cluster: PostgreSQL store and object-store artifacts, from the environment:
#   MLFLOW_BACKEND_STORE_URI=postgresql://user:pass@db:5432/mlflow \
#   MLFLOW_ARTIFACTS_DESTINATION=s3://your-bucket/mlflow-artifacts \
#   MLFLOW_HOST=0.0.0.0 mlflow/server.sh       # only behind a private network or a proxy with auth
#
# Jobs then point at it with MLFLOW_TRACKING_URI=http://<host>:<port>.
#
# Environment:
#   MLFLOW_HOST                   bind address (default 127.0.0.1)
#   MLFLOW_PORT                   port (default 5000)
#   MLFLOW_BACKEND_STORE_URI      default sqlite:///$ADLM_WORKDIR/mlflow-server.db
#   MLFLOW_ARTIFACTS_DESTINATION  default $ADLM_WORKDIR/mlartifacts-server
#   MLFLOW_WORKERS                gunicorn/uvicorn workers (default 1)
set -euo pipefail

workdir="${ADLM_WORKDIR:-$(pwd)/work}"
mkdir -p "$workdir"
host="${MLFLOW_HOST:-127.0.0.1}"
port="${MLFLOW_PORT:-5000}"
store="${MLFLOW_BACKEND_STORE_URI:-sqlite:///$workdir/mlflow-server.db}"
artifacts="${MLFLOW_ARTIFACTS_DESTINATION:-$workdir/mlartifacts-server}"
workers="${MLFLOW_WORKERS:-1}"

# The job-execution workers of MLflow 3 cost ~1.2 GB and are not used by the pipeline.
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION="${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}"
export MLFLOW_DISABLE_TELEMETRY="${MLFLOW_DISABLE_TELEMETRY:-true}"

case "$store" in
  postgresql*) python - <<'PY' || { echo "mlflow/server.sh: PostgreSQL store needs psycopg2: pip install psycopg2-binary" >&2; exit 2; }
import psycopg2  # noqa: F401
PY
  ;;
esac

echo "mlflow/server.sh: store=$store artifacts=$artifacts on http://$host:$port" >&2
exec mlflow server \
  --backend-store-uri "$store" \
  --artifacts-destination "$artifacts" \
  --serve-artifacts \
  --host "$host" \
  --port "$port" \
  --workers "$workers"
