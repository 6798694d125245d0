# The GPU workers' image (cluster.yaml: available_node_types.gpu_worker.docker.worker_image): Ray of the pinned
# version, CUDA torch==2.13.0 and flash-attn built once here instead of on every node boot, and the project's
# dependencies. The checkout itself is installed at node start (pip install --no-deps -e ~/adlm).
#   docker build -f configs/gpu.Dockerfile -t <registry>/adlm-gpu:0.1.0 . && docker push <registry>/adlm-gpu:0.1.0
FROM rayproject/ray:2.60.0-py311-cu124

# torch first and pinned (the project pins it), from the CUDA index.
RUN pip install --no-cache-dir "torch==2.13.0" --index-url https://download.pytorch.org/whl/cu124

# flash-attn needs torch present at build time and a CUDA toolchain (the -cu124 image has one).
RUN pip install --no-cache-dir ninja packaging && \
    MAX_JOBS=8 pip install --no-cache-dir --no-build-isolation "flash-attn>=2.6"

# The project's dependencies (not the project: the checkout arrives with the cluster's file mounts).
COPY pyproject.toml /tmp/adlm/pyproject.toml
RUN python -c "import tomllib; d = tomllib.load(open('/tmp/adlm/pyproject.toml', 'rb')); \
open('/tmp/adlm/requirements.txt', 'w').write('\n'.join(d['project']['dependencies']))" && \
    pip install --no-cache-dir -r /tmp/adlm/requirements.txt && rm -rf /tmp/adlm
