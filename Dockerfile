# One image for worker and producer. GPU hosts: the onnxruntime-gpu wheel is installed on
# linux/x86_64; run with the NVIDIA container toolkit (see compose.yaml's gpu profile).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY producer ./producer
COPY worker ./worker
COPY configs ./configs
RUN pip install ".[demo]" \
 && python -c "from worker.synthetic import save; save('demo', 'models/demo.onnx')"

USER 65534:65534
ENTRYPOINT ["redbatch-worker"]
CMD ["--config", "configs/demo.toml", "--log-format", "json"]
