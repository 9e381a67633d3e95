# One image for every fleetgate process of docker-compose.yml: coordinators, simulators, workers.
#
#   docker build -t fleetgate:dev .
#   docker run --rm fleetgate:dev --help                      # the `fleetgate` CLI
#   docker run --rm fleetgate:dev sim vllm --host 0.0.0.0     # a vLLM simulator on :8000
#   docker run --rm fleetgate:dev proxy --help                # gateway mode
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Only what the package is built from (see .dockerignore); tests, docs and benchmarks stay out.
WORKDIR /src
COPY pyproject.toml README.md ./
COPY fleetgate ./fleetgate
COPY client ./client
COPY coordinator ./coordinator
COPY lua ./lua
COPY proxy ./proxy
COPY tools ./tools
COPY demo ./demo
COPY testing ./testing
COPY cli ./cli
RUN pip install ".[sim,proxy,fast]" \
    && rm -rf /src \
    && useradd --system --create-home --uid 10001 fleetgate

USER fleetgate
WORKDIR /home/fleetgate
# 9464: coordinator /metrics, 9100: worker /metrics, 8000: simulators, 8080: fleetgate proxy
EXPOSE 8000 8080 9100 9464
ENTRYPOINT ["fleetgate"]
CMD ["--help"]
