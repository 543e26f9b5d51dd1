# The example job service of docker/compose.yml: Spark (local mode, Java 17) and twophase
# with every extra, running `twophase demo` against the compose stack.
#   docker build -f docker/job.Dockerfile -t twophase-job .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       openjdk-17-jre-headless \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY pyproject.toml README.md ./
COPY twophase ./twophase
COPY coordinator ./coordinator
COPY sinks ./sinks
RUN pip install ".[all]" && rm -rf /src

RUN useradd --system --uid 10002 --create-home --shell /usr/sbin/nologin job \
    && mkdir -p /work && chown job /work
USER job
WORKDIR /work
CMD ["twophase", "demo", "--help"]
