# syntax=docker/dockerfile:1.7
# The RL runtime and trainer for AMD GPUs: `rljob run <job.yaml>` with a ROCm build of PyTorch (the pip
# wheels bundle the ROCm user-space libraries; the node provides the amdgpu driver and /dev/kfd, /dev/dri).
# ROCm PyTorch exposes AMD GPUs as the "cuda" device. The operator picks this image for trainer.vendor amd
# (operator/builders/vendor.py TRAINER_IMAGES). Build from the repository root:
#   docker build -f images/runtime-rocm.Dockerfile -t rljob/runtime:0.1.0-rocm .
# TORCH_INDEX_URL: the ROCm variant of the PyTorch wheel index that exists for TORCH_VERSION.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/rocm6.4
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# The build fails when the index served a wheel without HIP: a GPU trainer must never get a CPU build.
RUN python -m venv /opt/rljob \
 && /opt/rljob/bin/pip install --require-virtualenv "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
 && /opt/rljob/bin/python -c "import torch, sys; sys.exit(0 if torch.version.hip else 'torch has no ROCm/HIP: check TORCH_INDEX_URL')"
COPY images/runtime-requirements.txt /tmp/requirements.txt
RUN /opt/rljob/bin/pip install --require-virtualenv -r /tmp/requirements.txt
COPY pyproject.toml setup.py README.md ./
COPY api/ api/
COPY common/ common/
COPY runtime/ runtime/
RUN /opt/rljob/bin/pip install --require-virtualenv --no-deps . \
 && /opt/rljob/bin/rljob --help >/dev/null

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="rljob-runtime-rocm" \
      org.opencontainers.image.description="rljob RL runtime and trainer (rljob run), PyTorch for AMD ROCm" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/rljob/rljob"
# The GPU device nodes belong to the video and render groups; when the node's ids differ, add them as the
# pod's supplementalGroups.
RUN (getent group video || groupadd --system video) \
 && (getent group render || groupadd --system render) \
 && groupadd --gid 1000 rljob \
 && useradd --uid 1000 --gid 1000 --groups video,render --create-home --home-dir /home/rljob \
      --shell /usr/sbin/nologin rljob \
 && install -d -o 1000 -g 1000 /var/lib/rljob/checkpoints
COPY --from=build /opt/rljob /opt/rljob
ENV PATH=/opt/rljob/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/rljob \
    HF_HOME=/home/rljob/.cache/huggingface
WORKDIR /home/rljob
USER 1000:1000
# 9400: Prometheus /metrics of the runtime (the trainer pods' readiness probe); 29500: torch rendezvous.
EXPOSE 9400 29500
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9400/metrics', timeout=4)"]
ENTRYPOINT ["rljob"]
CMD ["--help"]
