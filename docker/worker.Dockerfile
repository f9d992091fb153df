# The kvguard engine worker (prefill, decode or router: `kvguard worker --role ...`).
# CPU torch by default; for GPUs build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
# Build: docker build -f docker/worker.Dockerfile -t ghcr.io/kvguard/worker:0.1.0 .
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HOME=/tmp
WORKDIR /src
RUN pip install --index-url "$TORCH_INDEX" torch==2.13.0
COPY pyproject.toml README.md ./
COPY kvguard kvguard
COPY operator operator
COPY workers workers
RUN pip install '.[workers]' && rm -rf /src
# Pods run it with a read-only root filesystem; /tmp, /cache and /dev/shm are emptyDirs.
USER 1000:1000
ENTRYPOINT ["kvguard", "worker"]
