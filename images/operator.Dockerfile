# syntax=docker/dockerfile:1.7
# The RLJob operator (kopf): `python -m rljob.operator`. Build from the repository root:
#   docker build -f images/operator.Dockerfile -t rljob/operator:0.1.0 .
# No torch: the operator imports only the API models, builders and autotuner.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY images/operator-requirements.txt /tmp/requirements.txt
RUN python -m venv /opt/rljob \
 && /opt/rljob/bin/pip install --require-virtualenv -r /tmp/requirements.txt
COPY pyproject.toml setup.py README.md ./
COPY api/ api/
COPY common/ common/
COPY operator/ operator/
# --no-deps: the pinned requirements above are the whole dependency set (torch is deliberately absent).
RUN /opt/rljob/bin/pip install --require-virtualenv --no-deps . \
 && /opt/rljob/bin/python -c "import rljob.operator.handlers"

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="rljob-operator" \
      org.opencontainers.image.description="Kubernetes operator for RLJob (APRIL partial-rollout RL post-training)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/rljob/rljob"
COPY --from=build /opt/rljob /opt/rljob
ENV PATH=/opt/rljob/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
# Matches the chart's podSecurityContext (runAsUser/runAsGroup 65532); the root filesystem can be read-only.
USER 65532:65532
# 8080: /metrics; 8081: kopf's liveness endpoint /healthz (probed by the chart's Deployment).
EXPOSE 8080 8081
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8081/healthz', timeout=4)"]
ENTRYPOINT ["python", "-m", "rljob.operator"]
CMD ["--all-namespaces"]
