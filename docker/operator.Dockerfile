# The kvguard operator: kopf + kubernetes client + the pure planner/render/canary code. No torch.
# Build: docker build -f docker/operator.Dockerfile -t ghcr.io/kvguard/operator:0.1.0 .
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvguard kvguard
COPY operator operator
COPY workers workers
RUN pip install '.[operator]' && python -P -c "import sys, kvguard.operator.handlers; assert 'torch' not in sys.modules" \
    && rm -rf /src
USER 65532:65532
ENTRYPOINT ["kvguard"]
CMD ["operator"]
