# shardsink: the two commands a newcomer needs are `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export PYSPARK_PYTHON := $(abspath $(VPY))
export PYSPARK_DRIVER_PYTHON := $(abspath $(VPY))

.PHONY: venv test test-fast up demo bench bench-shard bench-kafka bench-sink bench-controller bench-scale bench-sinks chaos lint typecheck clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet -e '.[test]'
	$(VPY) -m services.runtime.jvm build || echo "no class-data archive: Spark drivers start without it"
	touch $(STAMP)

venv: $(STAMP)

## make test: create .venv, install the project with its test dependencies, run the suite
test: $(STAMP)
	$(VPY) -m pytest $(ARGS)

## make demo: start the embedded stack, run the sink on a generated workload, verify the shard
demo: $(STAMP)
	$(VPY) -m services.demo $(ARGS)

## make test-fast: the tests that start neither the embedded stack nor Spark (the pure core and the adapters' unit tests; under 2 minutes)
test-fast: $(STAMP)
	$(VPY) -m pytest -m 'not stack and not campaign' $(ARGS)

## make up: run the embedded Kafka (Tansu) + S3 (moto) stack in the foreground (ARGS='--kafka-port N --s3-port M')
up: $(STAMP)
	$(VPY) -m shared.devstack $(ARGS)

## make bench-shard: shard storage layer benchmark (last line: JSON figures)
bench-shard: $(STAMP)
	$(VPY) bench/bench_shard.py $(ARGS)

## make bench-kafka: Kafka source/sink benchmark (last line: JSON figures)
bench-kafka: $(STAMP)
	$(VPY) bench/bench_kafka.py $(ARGS)

## make bench-controller: controller benchmark (peek of 1M rows, subscribe lag, compaction and the same compaction by DuckDB and Polars; last line: JSON)
bench-controller: $(STAMP)
	$(VPY) bench/bench_controller.py $(ARGS)

## make bench-sink: sink benchmark vs plain Spark, freshness, recovery (last line: JSON figures)
bench-sink: $(STAMP)
	$(VPY) bench/bench_sink.py $(ARGS)

## make bench-scale: sink scale curves (writer partitions 1..8, update rate and collection size by 10x; last line: JSON)
bench-scale: $(STAMP)
	$(VPY) bench/bench_scale.py $(ARGS)

## make bench-sinks: N sinks in one services application (ARGS='--sinks 1,10,100 --mode shared|per-sink --peer deltalake|spark'; --quick: 1,3): processes, RSS, CPU, freshness, start (last line: JSON)
bench-sinks: $(STAMP)
	$(VPY) bench/bench_sinks.py $(ARGS)

## make bench: every benchmark vs its baseline, results in bench/results/, plot, BENCHMARKS.md table (ARGS=--quick: smoke run)
bench: $(STAMP)
	$(VPY) -m pip install --quiet -e '.[bench]'
	$(VPY) bench/run_all.py $(ARGS)

## make chaos: fault campaign (SIGKILLs, S3 and Kafka faults, racing replicas) with a history checker (ARGS=--quick: short run)
chaos: $(STAMP)
	$(VPY) bench/chaos.py $(ARGS)

lint: $(STAMP)
	$(VPY) -m pip install --quiet -e '.[dev]'
	$(VPY) -m ruff check shardsink shared services

typecheck: $(STAMP)
	$(VPY) -m pip install --quiet -e '.[dev]'
	$(VPY) -m mypy shardsink shared services

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
