# The echo worker image: vLLM's image with echo installed; it runs `echo-worker join` (docs/workers.md).
#   docker build -f docker/worker.Dockerfile -t echo-worker .
#   docker run --gpus all echo-worker http://LEARNER:8650 --token TOKEN --engine.type vllm
# A marketplace provider ([scheduler.provider] type = "vast"/"skypilot") rents machines with this image
# and starts them with `echo-worker join URL --token <machine token>` (its `onstart`).
# The RUN pip lines are run in a fresh venv by tests/integration/test_dockerfile.py.
FROM vllm/vllm-openai:v0.11.0

WORKDIR /opt/echo
COPY pyproject.toml README.md ./
COPY echo ./echo
COPY worker ./worker
COPY broadcast ./broadcast
COPY learner ./learner
COPY scheduler ./scheduler
COPY netem ./netem
COPY configs ./configs

# vLLM and its torch come with the base image; pip keeps them (they satisfy echo's torch>=2.4).
RUN python3 -m pip install --no-cache-dir -e .
# Fails the build when echo cannot start (no GPU at build time is a SKIP, not a failure).
RUN echo-worker doctor --min-disk-gb 0

ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["echo-worker", "join"]
