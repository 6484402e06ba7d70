# syntax=docker/dockerfile:1.7
# The RL runtime and trainer for NVIDIA GPUs: `rljob run <job.yaml>` with a CUDA build of PyTorch (the pip
# wheels bundle the CUDA user-space libraries; the node provides the driver). The operator picks this image
# for trainer.vendor nvidia (operator/builders/vendor.py TRAINER_IMAGES). Build from the repository root:
#   docker build -f images/runtime-cuda.Dockerfile -t rljob/runtime:0.1.0-cuda .
# TORCH_INDEX_URL: the CUDA variant of the PyTorch wheel index that exists for TORCH_VERSION.
# TORCH_VERSION is the torch of the default SGLang image, not the 2.13.0 the tests run on CPU: trainer
# rank 0 joins the SGLang ranks' NCCL communicator (weight transport `distributed`), which needs the same
# NCCL build on both sides. images/torch-pairs.toml is the pairing; tests/unit/test_image_pins.py checks it.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.14.1
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# The build fails when the index served a CPU-only wheel: a GPU trainer must never get one.
RUN python -m venv /opt/rljob \
 && /opt/rljob/bin/pip install --require-virtualenv "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
 && /opt/rljob/bin/python -c "import torch, sys; sys.exit(0 if torch.version.cuda else 'torch has no CUDA: check TORCH_INDEX_URL')"
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
LABEL org.opencontainers.image.title="rljob-runtime-cuda" \
      org.opencontainers.image.description="rljob RL runtime and trainer (rljob run), PyTorch for NVIDIA CUDA" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/rljob/rljob"
RUN groupadd --gid 1000 rljob \
 && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/rljob --shell /usr/sbin/nologin rljob \
 && install -d -o 1000 -g 1000 /var/lib/rljob/checkpoints
COPY --from=build /opt/rljob /opt/rljob
# The NVIDIA container toolkit mounts the driver libraries for these capabilities.
ENV PATH=/opt/rljob/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/rljob \
    HF_HOME=/home/rljob/.cache/huggingface \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /home/rljob
USER 1000:1000
# 9400: Prometheus /metrics of the runtime (the trainer pods' readiness probe); 29500: torch rendezvous.
EXPOSE 9400 29500
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9400/metrics', timeout=4)"]
ENTRYPOINT ["rljob"]
CMD ["--help"]
