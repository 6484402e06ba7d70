# syntax=docker/dockerfile:1.7
# The sglang router of an RLJob (`python3 -m sglang_router.launch_router`): CPU-only HTTP load balancing,
# so a slim Python with the sglang-router package instead of the multi-gigabyte CUDA SGLang image.
#   docker build -f images/router.Dockerfile -t rljob/router:0.3.2 .
# Keep the sglang-router pin (router-requirements.txt) and the tag in step with SGLANG_ROUTER_VERSION in
# operator/builders/vendor.py.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY images/router-requirements.txt /tmp/requirements.txt
RUN python -m venv /opt/router \
 && /opt/router/bin/pip install --require-virtualenv -r /tmp/requirements.txt \
 && /opt/router/bin/python -m sglang_router.launch_router --help >/dev/null

FROM ${PYTHON_IMAGE}
ARG VERSION=0.3.2
LABEL org.opencontainers.image.title="rljob-router" \
      org.opencontainers.image.description="sglang router for RLJob inference pools (CPU only)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/rljob/rljob"
COPY --from=build /opt/router /opt/router
# python3 on PATH is the venv's, so the operator's `python3 -m sglang_router.launch_router` finds the package.
ENV PATH=/opt/router/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
# Matches the router pods' securityContext (runAsUser 65532); the root filesystem can be read-only.
USER 65532:65532
# 30000: the router's HTTP API (/generate, /workers, /readiness, /liveness).
EXPOSE 30000
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:30000/liveness', timeout=4)"]
ENTRYPOINT ["python3", "-m", "sglang_router.launch_router"]
CMD ["--help"]
