"""Adapters: the only modules that talk to S3, Kafka or Spark."""
