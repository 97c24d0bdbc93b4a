# The minisgl service on NVIDIA GPUs (the README's "Container" section says how to run it).
#   docker build -t minisgl .
#   docker run --gpus all --ipc=host -p 8000:8000 -v minisgl-cache:/cache minisgl --model ORG/NAME
# Arguments after the image name are `serve` flags; presets are in /opt/minisgl/configs.
# The CUDA of the base image and of the torch wheel go together: change both or neither.
ARG BASE_IMAGE=docker.io/nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# gcc and the Python headers: Triton compiles its kernel launchers at run time. The distribution's
# own versions (a pin would break as soon as the archive moves on to a security update).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    HF_HOME=/cache/huggingface MINISGL_CACHE_DIR=/cache/minisgl
RUN python3 -m venv /opt/venv

# Dependencies first, from pyproject.toml alone: a change to the code keeps this layer cached.
WORKDIR /opt/minisgl
COPY pyproject.toml ./
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}" \
    && python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
       > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt "torch==${TORCH_VERSION}" \
    && rm /tmp/requirements.txt

COPY README.md ./
COPY minisgl ./minisgl
COPY configs ./configs
RUN pip install --no-cache-dir --no-deps . && rm -rf build

# Model downloads (the hub cache, the default model) go to a volume, kept across containers.
# A numeric user, so that a runtime that requires a non-root user can check it.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin minisgl \
    && mkdir -p /cache && chown 10001:10001 /cache
VOLUME ["/cache"]
USER 10001:10001
WORKDIR /home/minisgl

EXPOSE 8000
# 200 only while every process of the service is up; loading a large model takes minutes.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# `python -m minisgl` is `serve`; listening on every address is what a container port mapping
# needs (a later --host, after the image name, replaces it).
ENTRYPOINT ["python", "-m", "minisgl", "--host", "0.0.0.0"]
