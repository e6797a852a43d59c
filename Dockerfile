# pagekeeper images. Three stages, two of them runnable targets:
#
#   build     generates the gRPC stubs from proto/ and builds every wheel (pagekeeper, with
#             its C accelerators, and its service dependencies); nothing
#             from it but /wheels reaches a runtime image.
#   service   (default target) python:3.11-slim + the wheels: `pagekeeper serve` as a
#             non-root user, health-checked by the project's own probe. The example scheduler
#             runs from this image too (pagekeeper_client ships in the same wheel).
#   worker    service + torch==2.13.0: the example worker (reference paged attention).
#
#   docker build -t pagekeeper:0.1.0 .
#   docker build --target worker -t pagekeeper-worker:0.1.0 .
#
# Nothing is downloaded at build time except packages from the Python package index through
# pip (no curl/wget of binaries; the health probe is Python, not grpc_health_probe).
# Needs BuildKit (Docker's default builder since 23.0) for RUN --mount.
#
# torch: the worker target installs torch==2.13.0 from the package index as configured
# (PyPI by default). PyPI's Linux x86_64 wheel is the CUDA build: it runs on CPU and on NVIDIA
# GPUs alike (the compose file's `gpu` profile needs exactly that), at the price of a large
# image (several GB of CUDA libraries). For a CPU-only worker image, point pip at PyTorch's
# CPU wheel index:  --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
#
# Override the base images (e.g. to pin them by digest) with --build-arg PYTHON_IMAGE=...
# (runtime) and --build-arg BUILD_IMAGE=... (build).

ARG PYTHON_IMAGE=python:3.11-slim
# The build stage compiles pagekeeper's optional C accelerators (page hashing, the page
# pool's loops, the client's decode rows): the full image of the same Python and Debian
# release has gcc and OpenSSL's headers; the runtime stage (slim) has the libcrypto the
# hashing extension links, as CPython's hashlib does. A build image without them still
# builds, with the pure-Python loops (same hashes, pages and events, slower).
ARG BUILD_IMAGE=python:3.11

# ---------------------------------------------------------------------------------------------
FROM ${BUILD_IMAGE} AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /src

# The stub generator's own dependency, pinned like pyproject's dev extra (a test checks the
# two pins agree). A layer of its own: it changes far less often than the sources.
RUN python -m pip install "grpcio-tools==1.85.1"

COPY pyproject.toml setup.py README.md ./
COPY proto/ proto/
COPY scripts/gen_stubs.py scripts/gen_stubs.py
COPY service/ service/
COPY client/ client/

# The build context leaves the committed stubs out (.dockerignore): the image's stubs are
# generated here from proto/, the one source of the wire format.
RUN python scripts/gen_stubs.py \
    && test -f client/pagekeeper_client/_proto/pagekeeper/v1/pagekeeper_pb2_grpc.py

# pagekeeper's wheel plus wheels of every service dependency, so the runtime stage installs
# offline (--no-index) and needs no compiler.
RUN python -m pip wheel --wheel-dir /wheels ".[service]"

# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS service

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# The wheels are bind-mounted from the build stage rather than copied: they never become a
# layer of the runtime image.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python -m pip install --no-index --find-links=/wheels "pagekeeper[service]"

# A fixed non-root uid: the shared-memory ring files are created mode 0600, so the workers
# (the worker target below) must run as this same user to map them.
RUN groupadd --system --gid 10001 pagekeeper \
    && useradd --system --uid 10001 --gid pagekeeper --no-create-home \
        --home-dir /var/lib/pagekeeper --shell /usr/sbin/nologin pagekeeper \
    && install -d -o pagekeeper -g pagekeeper -m 0750 /var/lib/pagekeeper \
    && install -d -o pagekeeper -g pagekeeper -m 0750 /run/pagekeeper

# Listen on every interface inside the container (compose publishes the ports it wants);
# durable state under /var/lib/pagekeeper (a named volume in docker-compose.yml: a new volume
# starts with this directory's owner, so the non-root service can write it); /run/pagekeeper
# is where compose puts the same-node socket (PAGEKEEPER_LOCAL_SOCKET, a volume shared with
# the scheduler's container), created the same way.
ENV PAGEKEEPER_GRPC_ADDRESS=0.0.0.0:50051 \
    PAGEKEEPER_HTTP_ADDRESS=0.0.0.0:8000 \
    PAGEKEEPER_DATA_DIR=/var/lib/pagekeeper

USER pagekeeper
WORKDIR /var/lib/pagekeeper
EXPOSE 50051 8000

# `pagekeeper serve` drains in-flight calls on SIGTERM (shutdown_grace_s) and unlinks its ring.
STOPSIGNAL SIGTERM

# The probe reads the same configuration as the service (PAGEKEEPER_* env, --config file), so
# it needs no arguments here: gRPC health SERVING, GET /readyz 200 and, where one is
# configured, the same-node socket answering; else exit 1.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-m", "pagekeeper.probe"]

ENTRYPOINT ["pagekeeper"]
CMD ["serve"]

# ---------------------------------------------------------------------------------------------
FROM service AS worker

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=

USER root
# An empty TORCH_INDEX_URL keeps pip's configured index (PyPI).
RUN python -m pip install ${TORCH_INDEX_URL:+--index-url "${TORCH_INDEX_URL}"} \
        "torch==${TORCH_VERSION}" \
    && python -c "import torch, pagekeeper_client.examples.worker"
USER pagekeeper

# A worker container is no pagekeeper service: the service's probe does not apply as is.
# docker-compose.yml gives each worker a check that its own registration is live
# (python -m pagekeeper.probe --expect-client NAME, PAGEKEEPER_HTTP_ADDRESS and
# PAGEKEEPER_GRPC_ADDRESS pointing at the service).
HEALTHCHECK NONE

ENTRYPOINT ["python", "-m", "pagekeeper_client.examples.worker"]
CMD []
