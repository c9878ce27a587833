"""shardsink shared core: frontiers, shard state, correction buffer, codecs, and the adapters
(object store, Kafka, Spark) that the services use.

The pure core (``frontier``, ``errors``, ``state``, ``correction``, ...) imports no boto3,
confluent_kafka or pyspark; I/O lives in ``shared.io``.
"""
