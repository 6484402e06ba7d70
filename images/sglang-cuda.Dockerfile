# syntax=docker/dockerfile:1.7
# SGLang inference server for NVIDIA GPUs (CUDA), hardened for RLJob inference pools: non-root user,
# writable caches under its home, health check on /health_generate. The operator's default pool image
# is the upstream tag below; set spec.rollout.pools[].image to this image to use it instead.
#   docker build -f images/sglang-cuda.Dockerfile -t rljob/sglang:v0.5.23-cuda .
# Keep SGLANG_IMAGE in step with SGLANG_VERSION in operator/builders/vendor.py.
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23
FROM ${SGLANG_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="rljob-sglang-cuda" \
      org.opencontainers.image.description="SGLang inference server (CUDA) for RLJob inference pools" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/rljob/rljob"
# uid 10001 stays clear of users that base images already define (ubuntu is 1000).
RUN groupadd --gid 10001 sglang \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/sglang --shell /usr/sbin/nologin sglang
ENV HOME=/home/sglang \
    HF_HOME=/home/sglang/.cache/huggingface \
    TRITON_CACHE_DIR=/home/sglang/.cache/triton \
    XDG_CACHE_HOME=/home/sglang/.cache \
    SGLANG_PORT=30000
WORKDIR /home/sglang
USER 10001:10001
# 30000: SGLang HTTP API (/generate, /abort_request, /update_weights_from_disk, /metrics with --enable-metrics).
# Health: /health_generate runs a 1-token generation (503 while loading); /health is the liveness endpoint.
EXPOSE 30000
HEALTHCHECK --interval=60s --timeout=60s --start-period=900s --retries=5 \
  CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health_generate' % os.environ.get('SGLANG_PORT', '30000'), timeout=55)"]
CMD ["python3", "-m", "sglang.launch_server", "--host", "0.0.0.0", "--port", "30000", "--enable-metrics"]
