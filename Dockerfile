# The minisgl service on NVIDIA GPUs.
#   docker build -t minisgl .
#   docker run --gpus all -p 8000:8000 -v /models:/models minisgl --model /models/X --host 0.0.0.0
# Arguments after the image name are `serve` flags; presets are in /opt/minisgl/configs.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

# gcc and the Python headers: Triton compiles its kernel launchers at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN python3 -m venv /opt/venv

WORKDIR /opt/minisgl
COPY pyproject.toml README.md ./
COPY minisgl ./minisgl
COPY configs ./configs
RUN pip install . && rm -rf build

RUN useradd --create-home --shell /usr/sbin/nologin minisgl
USER minisgl
WORKDIR /home/minisgl

EXPOSE 8000
# `python -m minisgl` is `serve` (the installed package's entry point).
ENTRYPOINT ["python", "-m", "minisgl"]
