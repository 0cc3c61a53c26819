# One image for worker and producer. On linux/x86_64 it installs onnxruntime-gpu, but not the
# CUDA and cuDNN libraries it needs: a plain build serves on the CPU everywhere. For GPU hosts,
# build with --build-arg ORT_EXTRAS=cuda,cudnn (about 3 GB more: CUDA and cuDNN as nvidia-* pip
# packages, which the worker preloads) and run with the NVIDIA container toolkit; compose.yaml's
# gpu profile does both.
FROM python:3.11-slim

ARG ORT_EXTRAS=""

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY producer ./producer
COPY worker ./worker
COPY configs ./configs
# tools/ is not installed: the demo producer (compose's demo profile) and the model builder run
# from /app, the checkout's layout.
COPY tools ./tools
RUN pip install ".[demo]" \
 && if [ -n "$ORT_EXTRAS" ]; then pip install "onnxruntime-gpu[$ORT_EXTRAS]"; fi \
 && python -c "from tools.synthetic import save; save('demo', 'models/demo.onnx')"

USER 65534:65534
ENTRYPOINT ["redbatch-worker"]
CMD ["--config", "configs/demo.toml", "--log-format", "json"]
