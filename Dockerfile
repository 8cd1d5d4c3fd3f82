# syntax=docker/dockerfile:1.7
# Three images from one file:
#   docker build --target operator -t omnipipe/operator:0.1.0 .
#   docker build --target router   -t omnipipe/router:0.1.0 .
#   docker build --target worker   -t omnipipe/worker:0.1.0 .
# The operator and router are slim Python images; the worker sits on the vLLM image
# (CUDA, torch and vLLM 0.32.0, the version the thinker's hidden-state tap is pinned to)
# and adds omnipipe[models]. No model is downloaded at build
# time: workers fetch or mount weights at run time. Everything runs as UID 10001, the
# user the operator's pod specs ask for.
# Base images are pinned by version; pin them by digest in your registry mirror.

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY omnipipe ./omnipipe
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && printf 'omnipipe[models] @ file://%s\n' /wheels/omnipipe-*.whl > /wheels/worker.txt

FROM ${PYTHON_IMAGE} AS slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin omnipipe
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER 10001:10001
ENTRYPOINT ["omnipipe"]

FROM slim AS operator
CMD ["operator"]

FROM slim AS router
EXPOSE 8000
CMD ["router", "--pipeline", "/etc/omnipipe/pipeline.yaml"]

FROM ${VLLM_IMAGE} AS worker
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/var/cache/omnipipe/huggingface OMNIPIPE_CACHE_DIR=/var/cache/omnipipe
COPY --from=wheel /wheels /wheels
# vLLM and torch come with the base image; the extras add diffusers, ucxx and the rest.
RUN pip install --no-cache-dir --requirement /wheels/worker.txt \
    && rm -rf /wheels \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin omnipipe \
    && mkdir -p /var/cache/omnipipe && chown 10001:10001 /var/cache/omnipipe
USER 10001:10001
EXPOSE 8100 8101
ENTRYPOINT ["omnipipe"]
CMD ["worker", "--pipeline", "/etc/omnipipe/pipeline.yaml"]
