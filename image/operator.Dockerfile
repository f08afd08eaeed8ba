# The eagle3-operator image: the kopf operator only (the `operator` extra: no torch, no CUDA), run as a
# non-root user. Build from the repository root (README, "Building the images"):
#   docker build -f image/operator.Dockerfile -t ghcr.io/eagle3-dev/eagle3-operator:0.1.0 .
# BASE: any Debian-family image with python3 (3.11 to 3.13) and its venv module; `make images` builds a
# Debian bookworm one with mmdebstrap where the default cannot be pulled.
ARG BASE=python:3.12.12-slim-bookworm
FROM ${BASE} AS build

# uv trusts the system CA store, so a build behind a TLS-inspecting proxy works (image/build.sh mounts its CA),
# and compiles the bytecode as pip would: a read-only root cannot cache it, so every start would compile it.
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 UV_NO_CACHE=1 UV_PYTHON_DOWNLOADS=never UV_SYSTEM_CERTS=1 \
    UV_COMPILE_BYTECODE=1
WORKDIR /src
# The distribution's metadata, both packages (setuptools finds them under image/ and operator/) and the lock
# that pins, with hashes, every package the operator installs: the versions the tests ran with.
COPY pyproject.toml README.md ./
COPY locks/uv.txt locks/operator.txt locks/
COPY image/eagle3_target/ image/eagle3_target/
COPY operator/eagle3_operator/ operator/eagle3_operator/
RUN python3 -m venv /tmp/uv && /tmp/uv/bin/pip install --quiet --no-deps --require-hashes -r locks/uv.txt \
    && /tmp/uv/bin/uv venv --quiet --python python3 /opt/venv \
    && /tmp/uv/bin/uv pip sync --python /opt/venv/bin/python --require-hashes locks/operator.txt \
    && /tmp/uv/bin/uv pip install --python /opt/venv/bin/python --no-deps .

FROM ${BASE}

ARG REVISION=unknown
LABEL org.opencontainers.image.title="eagle3-operator" \
      org.opencontainers.image.source="https://github.com/eagle3-dev/eagle3-target" \
      org.opencontainers.image.revision="${REVISION}"
# USER: the uid has no passwd entry (any uid works, OpenShift assigns one), and kopf names itself after
# getpass.getuser(), which reads $USER before it looks the uid up.
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 USER=eagle3-operator
COPY --from=build /opt/venv /opt/venv
# A numeric user, so the pod's runAsNonRoot check can verify it without a passwd lookup. Nothing is written
# outside /tmp (an emptyDir in the chart), so the root filesystem can be read-only.
USER 65532:65532
EXPOSE 8080 8081 8082
ENTRYPOINT ["eagle3-operator"]
CMD ["--all-namespaces"]
