# The image of every shardsink service: Python 3.11, Java 17 (for Spark; the JDK, whose javac
# builds the services' Hadoop classes in services/java), pyspark, the project.
FROM python:3.11-slim-bookworm

RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jdk-headless procps tini \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY shardsink ./shardsink
COPY shared ./shared
COPY services ./services
COPY schemas ./schemas
RUN pip install --no-cache-dir .
# The services' Hadoop jar (local files without a chmod process each), then the driver JVM's
# class-data archive (services/runtime/jvm.py): a service's SparkSession starts 3-4 s sooner with it.
# Built for this image's JDK and jars; a service starts without them if the build fails.
RUN python -m services.runtime.jvm build || echo "no class-data archive: services start without it"

ENV PYSPARK_PYTHON=python3 \
    SHARDSINK_SCHEMAS_DIR=/app/schemas \
    SHARDSINK_CHECKPOINT_DIR=/checkpoints

RUN useradd --create-home --uid 10001 shardsink && mkdir -p /checkpoints && chown shardsink /checkpoints
USER shardsink
VOLUME ["/checkpoints"]
EXPOSE 9400
ENTRYPOINT ["tini", "--"]
CMD ["python", "-m", "services"]
