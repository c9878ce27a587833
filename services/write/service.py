"""The write service: keeps the correction buffer ``desired - shard`` per writer partition and
stages the difference for each batch description. It never appends.

Contract (the seeds' write operator, with Kafka making order and completeness explicit):

- inputs: the sink's desired topic (updates and progress, partitioned by row hash) and
  ``descs`` (batch descriptions). The shard is read back at every micro-batch that holds or
  receives a description, before it is decided, so ``frontiers`` is not read: an upper
  advance alone would cost a micro-batch that decides nothing (the next description, minted
  only after mint saw that upper, triggers the read-back it needs). A description minted at an
  announced upper carries what that append added (``BatchDescription.appended``): a partition
  whose contents reach the append's lower absorbs those objects without reading the shard's
  state (:meth:`services.write.context.ShardContext.follow_appended`);
- state: one :class:`shared.write_state.WriteState` per writer partition (= desired topic
  partition), kept **on the executors** and checkpointed with the source offsets: the task
  that processes a partition in micro-batch N loads the partition's newest state version
  written before N and writes version N under the query's checkpoint; Spark's commit of batch
  N makes it live (:mod:`shared.spark.state_files`, Spark's state store protocol in files the
  task handles itself). Desired updates go in positively; the shard's own contents (a
  snapshot at the partition's first start, then each appended range) go in negated, routed by
  the same row hash;
- for a description whose lower equals the persist frontier and whose upper is at or below
  the partition's desired frontier, the partition stages its consolidated updates before
  ``upper`` as data objects (named ``...-w<p>of<n>.parquet``), and reports on ``batches``
  (also when there is nothing to write);
- bad input (undecodable messages, rows that do not match the schema or whose writer schema is
  no version of the collection, updates below their partition's progress) becomes error rows
  at their time, in the shard's error collection;
- schema evolution: the collection's row schema may be altered while the sink runs. The step
  follows the shard's schema versions live (no restart): buffered keys are re-keyed to the
  current schema when it changes, desired rows of every version are resolved to it, shard
  parts are read as it, and the staged parts are written in it (see
  :class:`services.write.context.ShardContext`). An alter alone writes nothing.

Where the work runs. Executors, one task per writer partition with input, in one stage and one
Python worker: the write source's ``read()`` (:mod:`services.write.source`) reads the
partition's desired range and the micro-batch's control range, decodes them, and runs the write
step on them (:func:`services.write.executor.write_step`): absorbs the desired updates, reads
the shard back, consolidates, decides and stages Parquet objects to S3. Only the step's output
(a report and statistics per partition) enters the JVM: the updates never do, so no
Arrow-to-rows-to-Arrow conversion is paid per update. A partition's own staged objects come
back from its state when they are appended (no read, no re-encode); only objects written by
others (a racing replica, the controller's ``Append``, compaction) are read and routed. The
driver sees only the reports (one small row per partition per description) and produces them.
(With the builtin Kafka connector, a ``mapInArrow`` decodes and another runs the step after a
shuffle by writer partition.)

Recovery: a restarted query resumes from its checkpoint (``<checkpoint root>/write/<sink>-e<epoch>``,
durable across restarts): state and offsets together, so nothing is re-read from the topic's
history and recovery time depends on the state's size (the in-flight difference), not on
history. Every micro-batch is bounded by admission control (``maxRecordsPerTrigger``), also
the catch-up after a long outage. A re-run micro-batch (a failed attempt) re-stages from the
previous state version; the appender appends one report per partition per description, and
the orphaned objects are collected after the grace period.

Retention safety (the contract; see docs/operations.md, "Retention safety"):

- the sink never retracts a row only because its insert is no longer on the desired topic;
- a writer partition proves it has seen the desired history behind the shard by reading its
  partition from offset 0 (a fresh checkpoint starts there) or from its checkpoint's offsets,
  with nothing deleted in between. The source compares each micro-batch's start offsets with
  the partition's low watermark and marks a gap (:data:`shared.spark.kafka_source.HISTORY_GAP_HEADER`);
- a gap after the partition absorbed anything (shard rows or desired updates) cannot be
  proven harmless: the partition refuses to write (:class:`shared.write_state.Refuse`), so the
  sink writes nothing, and nothing that deletes. It logs
  :class:`shared.errors.HistoryUnprovenError`, sets the metric
  ``shardsink_write_history_unproven_partitions`` and the sink's health object, which
  ``shardsink status`` shows, and stays so until an operator acts:
  ``shardsink sink adopt <sink>`` (or ``sink create --adopt-shard``) takes the shard's
  current contents as the desired baseline (a new epoch, a fresh checkpoint) and corrects
  only from the shard's upper on;
- a gap before anything was absorbed (a sink created on an empty collection, or an adopted
  baseline) is harmless: the sink writes what it reads, as before.

Quarantine: a micro-batch that fails again and again on the same input (a value the code cannot
handle, for example) would stall the sink for good. The supervisor reports each failure of the
write query (:func:`services.write.quarantine.on_write_failure`); when the same planned
micro-batch (the checkpoint's pending offsets) failed ``quarantine_after`` times (default 3)
with an error raised in the Python step that is not an infrastructure error (S3, Kafka, lost
history, protocol), its desired topic ranges are recorded in the sink's quarantine object
(``sink-health/<sink>-e<epoch>.quarantine.json``): the ranges of the writer partition the
failure names (the write step notes it on what it raises), else every range of the batch. The
restarted query decodes the updates of those ranges as error rows at their own time (source
offset, reason and the row as JSON in the error text), so they land in the error collection and
the sink goes on; progress statements in the ranges keep counting. ``shardsink status`` and the
metric ``shardsink_write_quarantined_ranges`` show it. Quarantine never retracts: the rows
never reach the correction buffer. Failures are counted in the same S3 object (``failing``), so
the count survives a restart of the service, and ``status`` shows a batch failing before it is
quarantined. Narrower than a partition's range (the offending records alone) would take a
re-run per halving of the range, each a query restart of seconds, for a failure that per-value
checks (decode, read-back) already keep from happening on bad values: a quarantined range loses
nothing (each update is an error row with its row), so it is not done.

Micro-batch order inside a writer partition's task (all on the executor):

1. load the partition's newest state version before this batch (or start it: absorb the
   shard's snapshot, or adopt it); re-key it if the row schema changed since it was saved;
2. resolve the desired rows to the current row schema; absorb history gaps, desired updates
   and progress in offset order;
3. when a description is held or arrives: read the shard's head; absorb (negated) everything
   appended since the persist frontier (a micro-batch without one defers this to the next
   that has one: nothing is decided before it);
4. absorb descriptions; decide; stage data objects (S3); write this batch's state version;
   emit reports.

Then on the driver (``foreachBatch``): set the micro-batch id as the job's local property
(:data:`services.write.source.BATCH_PROPERTY`), run the batch's job, produce the reports it
returns and flush them; only then does Spark commit the micro-batch (offsets), which makes
the state versions live. (The shared query, :mod:`services.write.shared`, produces each unit's
report from the executor as the unit ends, after its state version is written; the driver
produces those the executor could not deliver. Either way every report is out before the
commit.)
A batch that fails before its commit is re-run with the same id and offsets from the versions
before it; what its failed attempt staged is collected after the grace period.

Where the code lives (each module imports only those listed before it):

- :mod:`services.write.job`: the :class:`~services.write.job.WriteJob` the driver hands its
  tasks and the rows they hand back (:data:`~services.write.job.OUTPUT_DDL`);
- :mod:`services.write.heads`: the shard heads an executor's Python workers tell each other
  (a seqno hint per shard, so a worker that missed a sink's last steps reads one state);
- :mod:`services.write.context`: the executor process's view of the shard (read-back, schema
  evolution, staging);
- :mod:`services.write.executor`: the write step of a writer partition's task (the order
  above);
- :mod:`services.write.source`: the write source, whose ``read()`` decodes the input and runs
  the step;
- :mod:`services.write.quarantine`: the failure hook and the quarantined ranges;
- :mod:`services.write.driver`: the query and its ``foreachBatch`` (reports, metrics, health);
- this module: the contract, and the two names the service runner starts the service with
  (:func:`start_write_query`, :func:`on_write_failure`).
"""

from __future__ import annotations

from services.write.driver import start_write_query
from services.write.quarantine import on_write_failure

__all__ = ["on_write_failure", "start_write_query"]
