# speedrun on GPU. Build: docker build -t speedrun .
# Run (data downloaded on the host into ./data/fineweb10B):
#   docker run --gpus all --ipc=host -v "$PWD/data:/speedrun/data" -v "$PWD/logs:/speedrun/logs" speedrun
# The devel image carries the C compiler that Triton and torch.compile need at run time.
FROM pytorch/pytorch:2.10.0-cuda12.8-cudnn9-devel

WORKDIR /speedrun
COPY requirements.txt .
RUN pip install --no-cache-dir -r requirements.txt
COPY train_gpt.py run.sh ./
COPY data/*.py data/
COPY records/ records/
VOLUME ["/speedrun/data/fineweb10B", "/speedrun/logs"]
ENTRYPOINT ["./run.sh"]
