# The eagle3-target server image on SGLang's official image: the `server` extra on top, so SGLang 0.5.23, its
# CUDA kernels (sgl_kernel) and its torch come from SGLang's release unchanged; the default engine is sglang
# (the HF engine works in it too). Build from the repository root (`make images` prints these commands where
# it cannot pull the base):
#   docker build -f image/sglang.Dockerfile -t ghcr.io/eagle3-dev/eagle3-target:0.1.0-sglang .
# and set the chart's sglangServerImage (or a target's spec.image) to it for targets with engine: sglang.
ARG BASE=lmsysorg/sglang:v0.5.23
FROM ${BASE}

ARG REVISION=unknown
LABEL org.opencontainers.image.title="eagle3-target" \
      org.opencontainers.image.source="https://github.com/eagle3-dev/eagle3-target" \
      org.opencontainers.image.revision="${REVISION}"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 UV_NO_CACHE=1 UV_PYTHON_DOWNLOADS=never UV_SYSTEM_CERTS=1 \
    UV_COMPILE_BYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY locks/ locks/
COPY image/keep_base.py image/keep_base.py
COPY image/eagle3_target/ image/eagle3_target/
COPY operator/eagle3_operator/ operator/eagle3_operator/
# SGLang, its kernels and torch stay as the base image installed them: keep_base.py leaves every package the
# base has out of the server lock, and fails the build where the base disagrees with a pin of the `server` or
# `client` extra, except on what SGLang itself pins exactly (--engine sglang): SGLang 0.5.23's torch 2.14.1
# and transformers 5.19.0 stay, where the extras pin vLLM's torch 2.14.0 and transformers 5.20.2 (the
# extras' pins hold in the vLLM image; SGLang's kernels are built against its torch). The rest is installed
# at the locked versions, hashes checked (tests/image/test_image_requirements.py resolves the set).
RUN python3 -m venv /tmp/uv && /tmp/uv/bin/pip install --quiet --no-deps --require-hashes -r locks/uv.txt \
    && python3 image/keep_base.py locks/server.txt server client --engine sglang > /tmp/rest.txt \
    && /tmp/uv/bin/uv pip install --python "$(command -v python3)" --break-system-packages \
        --no-deps --require-hashes -r /tmp/rest.txt \
    && /tmp/uv/bin/uv pip install --python "$(command -v python3)" --break-system-packages --no-deps . \
    && rm -rf /src /tmp/uv /tmp/rest.txt
# The base's torch and transformers are not the ones the extras pin: import what `serve` runs (its command
# line, the server, the SGLang runner; sglang itself is imported when a model loads, so no GPU is needed
# here), so a base that breaks our code fails the build instead of the first pod.
RUN python3 -c "import eagle3_target.cli, eagle3_target.server.app, eagle3_target.runners.sglang"

RUN useradd --uid 10001 --gid 0 --create-home --home-dir /home/eagle3 eagle3 \
    && chmod -R g=u /home/eagle3
ENV HOME=/home/eagle3 PYTHONUNBUFFERED=1 \
    EAGLE3_TARGET_ENGINE=sglang
WORKDIR /home/eagle3
USER 10001:0
EXPOSE 8000
ENTRYPOINT ["eagle3-target", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
