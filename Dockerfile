# One image for every ipuserve role: broker, worker and client (`ipuserve ...`).
#
#   pip wheel . -w wheelhouse                       # on the host: the project and its deps
#   docker build -t ipuserve .                      # base: the official Python slim image
#   docker build --build-arg BASE_IMAGE=ipuserve-base:bookworm -t ipuserve .
#
# The base must provide `python3` (>= 3.11) with the `venv` module; the official
# python:3.11-slim image does, and so does the debootstrap image CI builds
# (.ci/base-image.sh), where no image can be pulled. The project is installed from
# the host-built wheelhouse with --no-index, because a build container may not reach
# the package registry. Without a wheelhouse the build falls back to installing the
# source tree with pip (which then needs the registry). See docs/deploy.md.
#
# No `# syntax=` line on purpose: it would make BuildKit pull a frontend image.

ARG BASE_IMAGE=python:3.11-slim

# ---------------------------------------------------------------------------
# build: a virtual environment holding ipuserve and its dependencies
FROM ${BASE_IMAGE} AS build
# Marks this stage's (untagged) images so CI can prune them and nothing else.
LABEL org.ipuserve.stage=build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python3 -m venv /opt/ipuserve

# .dockerignore keeps the context to the sources, pyproject.toml and wheelhouse/.
COPY . /src
RUN set -eu; \
    if ls /src/wheelhouse/ipuserve-*.whl >/dev/null 2>&1; then \
        /opt/ipuserve/bin/pip install --no-index --find-links /src/wheelhouse ipuserve; \
    else \
        echo "no wheelhouse/ipuserve-*.whl: installing the source tree from the registry" >&2; \
        /opt/ipuserve/bin/pip install /src; \
    fi; \
    /opt/ipuserve/bin/ipuserve --version

# ---------------------------------------------------------------------------
# runtime: the venv, the example models, an unprivileged user
FROM ${BASE_IMAGE}

ARG IPUSERVE_UID=10001
# Example models written at build time by the project's own CLI, as /models/NAME.popef.
# Build with --build-arg IPUSERVE_EXAMPLE_MODELS="" to bake none (mount your own).
ARG IPUSERVE_EXAMPLE_MODELS="mlp noop simple"
# A model repository baked as /repository (docs/repository_layout.md): each of these
# examples as versions 1 and 2 (weights of seed 1 and 2), for repository workers
# (`ipuserve worker --repository /repository`) to load at run time. compose.yaml mounts
# a named volume there, which Docker fills from this folder the first time.
ARG IPUSERVE_REPOSITORY_MODELS="simple"

# One BLAS thread per process: numpy's OpenBLAS otherwise starts a spinning thread
# per host core in every worker, and a few workers on one host then spend their
# time fighting over the cores (measured: 9 vs 531 req/s, 3 mlp workers, 2 cores).
ENV PATH=/opt/ipuserve/bin:${PATH} \
    VIRTUAL_ENV=/opt/ipuserve \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    IPUSERVE_LOG_LEVEL=INFO \
    OPENBLAS_NUM_THREADS=1 \
    OMP_NUM_THREADS=1

COPY --from=build /opt/ipuserve /opt/ipuserve

RUN set -eu; \
    groupadd --system --gid "${IPUSERVE_UID}" ipuserve; \
    useradd --system --uid "${IPUSERVE_UID}" --gid ipuserve --create-home \
        --home-dir /home/ipuserve --shell /usr/sbin/nologin ipuserve; \
    mkdir -p /models; \
    install -d -m 0700 -o ipuserve -g ipuserve /keys; \
    for name in ${IPUSERVE_EXAMPLE_MODELS}; do \
        ipuserve model example "${name}" "/models/${name}.popef"; \
    done; \
    chmod -R a+rX /models; \
    mkdir -p /repository; \
    for name in ${IPUSERVE_REPOSITORY_MODELS}; do \
        for version in 1 2; do \
            ipuserve model example "${name}" --repository /repository \
                --version "${version}" --seed "${version}" >/dev/null; \
        done; \
    done; \
    chown -R ipuserve:ipuserve /repository; \
    chmod -R a+rX /repository

LABEL org.opencontainers.image.title="ipuserve" \
      org.opencontainers.image.description="Distributed inference on simulated Graphcore IPUs: broker, worker and client"

USER ipuserve
WORKDIR /home/ipuserve

# 5555: broker frontend (clients), 5556: broker backend (workers),
# 9100: the broker's Prometheus metrics (compose.yaml turns it on).
# /keys: owned by the service user, so a named volume mounted there (compose.yaml's
# `keys`) starts owned by it too and `ipuserve keys generate` can write into it.
EXPOSE 5555 5556 9100
# Workers drain in-flight requests on SIGTERM; compose.yaml runs an init (tini) as
# PID 1 so the signal reaches ipuserve, and gives it a grace period.
STOPSIGNAL SIGTERM
ENTRYPOINT ["ipuserve"]
CMD ["--help"]
