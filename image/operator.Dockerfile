# The eagle3-operator image: the kopf operator only (the `operator` extra: no torch, no CUDA), run as a
# non-root user. Build from the repository root:
#   docker build -f image/operator.Dockerfile -t ghcr.io/eagle3-dev/eagle3-operator:0.1.0 .
FROM python:3.12.12-slim-bookworm AS build

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# The distribution's metadata and both packages (setuptools finds them under image/ and operator/).
COPY pyproject.toml README.md ./
COPY image/eagle3_target/ image/eagle3_target/
COPY operator/eagle3_operator/ operator/eagle3_operator/
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install "pip==26.0.1" \
    && /opt/venv/bin/pip install ".[operator]"

FROM python:3.12.12-slim-bookworm

ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
COPY --from=build /opt/venv /opt/venv
# A numeric user, so the pod's runAsNonRoot check can verify it without a passwd lookup.
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["eagle3-operator"]
CMD ["--all-namespaces"]
