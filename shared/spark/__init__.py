"""The Spark adapters: the Kafka source and sink for Spark, the ``shardsink`` batch reader, the
writer's executor-side state files and executor helpers."""
