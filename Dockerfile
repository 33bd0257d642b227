# apbv serve on CUDA GPUs: the OpenAI-compatible server, its H rank actors on this container's
# GPUs (docs/deployment.md). The base image brings CUDA and torch; pip keeps its torch.
#   docker build -t apbv .
#   docker run --gpus all --shm-size 16g -p 8000:8000 -v /data/videos:/media:ro \
#     -v /ckpt:/models:ro apbv --config qwen2_5_vl_7b_8gpu --model /models/Qwen2.5-VL-7B-Instruct
# Settings: flags after the image name, APBV_SERVE_* variables (-e), or a file
# (-v ./serve.toml:/etc/apbv/serve.toml:ro -e APBV_SERVE_CONFIG_FILE=/etc/apbv/serve.toml).
ARG BASE_IMAGE=pytorch/pytorch:2.14.1-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /opt/apbv
COPY pyproject.toml README.md LICENSE ./
COPY apbv ./apbv
RUN pip install --no-cache-dir "/opt/apbv[video,serve]" \
    && useradd --create-home --uid 1000 apbv \
    && mkdir -p /media \
    && chown apbv /media

# the apbv user made above, by number (resolvable without its /etc/passwd entry)
USER 1000
WORKDIR /home/apbv
# Requests name videos under the media root (file:///media/...); mount them read-only.
VOLUME ["/media"]
# Every interface of the container (the Host check then takes any IP address with the port).
ENV APBV_SERVE_HOST=0.0.0.0 APBV_SERVE_MEDIA_ROOT=/media
EXPOSE 8000
# /health is 200 once every replica's ranks are ready (a 7B model loads for minutes); set the
# port with APBV_SERVE_PORT so that the check finds it.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('APBV_SERVE_PORT', '8000') + '/health', timeout=4)"]
ENTRYPOINT ["apbv", "serve"]
