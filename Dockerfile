# speedrun on GPU. Build: docker build -t speedrun .
# Run (data downloaded on the host into ./data/fineweb10B):
#   docker run --gpus all --ipc=host -v "$PWD/data/fineweb10B:/speedrun/data/fineweb10B" -v "$PWD/logs:/speedrun/logs" speedrun
# The CUDA devel image carries the C compiler that Triton and torch.compile need at run time.
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /speedrun
COPY requirements.txt .
# the torch version CI tests (.ci/run); its CUDA build comes with Triton
RUN pip install --no-cache-dir torch==2.13.0 && pip install --no-cache-dir -r requirements.txt
COPY train_gpt.py run.sh ./
COPY data/*.py data/
COPY records/ records/
COPY tools/ tools/
# compiled kernels persist on the logs volume, so a second run skips most of the compile time
ENV TORCHINDUCTOR_CACHE_DIR=/speedrun/logs/compile_cache TRITON_CACHE_DIR=/speedrun/logs/compile_cache/triton
VOLUME ["/speedrun/data/fineweb10B", "/speedrun/logs"]
ENTRYPOINT ["./run.sh"]
