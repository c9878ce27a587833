"""The compaction of ``make bench-controller`` against DuckDB and Polars on the same bytes (issue 31).

The parts a timed merge consolidated are copied from the S3 server to local files once
(untimed); then each engine consolidates **the same local files** the same way (times advanced
to since, updates of equal ``(row, _error, _time)`` summed, zero sums dropped, snappy Parquet
out), one after the other, ``reps`` times in turn (each rep in a rotated order), in this
process:

- ``ours``: what a merge runs (:meth:`shared.shard.Shard.merge_here`): the parts read and
  decoded on 8 threads (:func:`shared.shard_read.read_parts`, strings kept in Parquet's
  dictionaries as the merge reads them), :func:`shared.shard.merge_table`, the result written
  as parts (:meth:`shared.shard.Shard.write_parts`) to a local folder; its first merge sets
  what the controller's first merge sets too (:func:`shared.shard_merge.keep_freed_memory`:
  glibc keeps the merge's freed memory for the next one), for this process and so for the
  peers' runs in it as well;
- ``duckdb``: ``COPY (SELECT <row columns>, _error, greatest(_time, since) AS _time,
  SUM(_diff) AS _diff FROM read_parquet([...]) GROUP BY ALL HAVING SUM(_diff) <> 0) TO ...``
  with ``SET threads`` = the machine's cores;
- ``polars``: ``scan_parquet(...).with_columns(_time clipped at since).group_by(...)
  .agg(sum).filter(!= 0).sink_parquet(...)``.

Each figure is the median over the reps: MB/s of the input parts' bytes over the wall time,
and the CPU seconds of this process meanwhile (every thread). The outputs are then checked to
hold the same updates (the bench fails otherwise). Local copies for all, not the S3 server
for all: DuckDB 2.0.1 reads S3 through its ``httpfs`` extension, which it downloads at run
time from its own site (refused here; the package registry's ``duckdb-ext-httpfs`` is built
for DuckDB 1.4.4); reading local files leaves S3 out of the comparison for every engine. The
peers group floats by value (``0.0`` and ``-0.0`` as one, every NaN as one) where the merge
groups them by their bits: the bench's amounts are neither, so the outputs are equal.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from shared.errors import ObjectNotFoundError, PreconditionFailedError
from shared.frontier import Frontier
from shared.objectstore import ObjectInfo
from shared.shard import DIFF, ERROR, TIME, Shard, merge_table, schema_view
from shared.shard_read import read_parts


class LocalFiles:
    """An object store over a local folder (keys are relative paths): what ``ours`` reads
    the copies from and writes its parts to."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, key: str) -> Path:
        return self.root / key

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        p = self._path(key)
        if if_absent and p.exists():
            raise PreconditionFailedError(f"expected no object at {key!r}, found one", key=key)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectNotFoundError(f"expected an object at {key!r}, found none", key=key) from None

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def delete_many(self, keys: list[str]) -> None:
        for k in keys:
            self.delete(k)

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectInfo]:
        for p in sorted(self.root.rglob("*")):
            key = str(p.relative_to(self.root))
            if p.is_file() and key.startswith(prefix) and (start_after is None or key > start_after):
                st = p.stat()
                yield ObjectInfo(key, st.st_size, int(st.st_mtime * 1000))


def copy_parts(store: Any, keys: Sequence[str], folder: Path) -> list[str]:
    """Copy the objects ``keys`` of ``store`` into ``folder`` (same relative keys)."""
    local = LocalFiles(folder)
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda k: local.put(k, store.get(k)), keys))
    return list(keys)


def _ours(src: Path, keys: Sequence[str], out: Path, since: int, schema: dict[str, Any]) -> None:
    view = schema_view(schema)
    table = read_parts(LocalFiles(src), keys, view, threads=8, dictionaries=True)
    merged = merge_table(table, Frontier.at(since), view.row_columns, view.part_schema)
    Shard(LocalFiles(out), "peer-ours").write_parts(merged, view=view)


def _duckdb(files: Sequence[str], out: Path, since: int, row_columns: Sequence[str]) -> None:
    import duckdb

    cols = ", ".join(f'"{c}"' for c in [*row_columns, ERROR])
    listed = ", ".join(f"'{f}'" for f in files)
    with duckdb.connect() as con:
        con.execute(f"SET threads = {os.cpu_count() or 1}")
        con.execute(
            f"COPY (SELECT {cols}, greatest({TIME}, {since}::UBIGINT) AS {TIME}, SUM({DIFF})::BIGINT AS {DIFF} "
            f"FROM read_parquet([{listed}]) GROUP BY ALL HAVING SUM({DIFF}) <> 0) "
            f"TO '{out / 'duckdb.parquet'}' (FORMAT parquet, COMPRESSION snappy)"
        )


def _polars(files: Sequence[str], out: Path, since: int, row_columns: Sequence[str]) -> None:
    import polars as pl

    (
        pl.scan_parquet(list(files))
        .with_columns(pl.col(TIME).clip(lower_bound=since))
        .group_by([*row_columns, ERROR, TIME])
        .agg(pl.col(DIFF).sum())
        .filter(pl.col(DIFF) != 0)
        .sink_parquet(str(out / "polars.parquet"), compression="snappy")
    )


def _contents(folder: Path, columns: Sequence[str]) -> pa.Table:
    """The updates written under ``folder``, in one comparable form (sorted, common types)."""
    files = sorted(str(p) for p in folder.rglob("*.parquet"))
    table = pa.concat_tables([pq.read_table(f).select(list(columns)) for f in files])
    table = table.cast(pa.schema([pa.field(c, pa.large_string() if pa.types.is_string(t) or
                                            pa.types.is_large_string(t) or pa.types.is_string_view(t) else
                                            pa.uint64() if c == TIME else pa.int64() if c == DIFF else t)
                                  for c, t in zip(table.column_names, table.schema.types, strict=True)]))
    return table.sort_by([(c, "ascending") for c in columns])


def compare(
    store: Any, keys: Sequence[str], since: int, schema: dict[str, Any], *, reps: int = 3,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Consolidate the parts ``keys`` of ``store`` with ours, DuckDB and Polars from local copies
    (module docstring); their MB/s and CPU seconds (medians) and our ratios to each."""
    view = schema_view(schema)
    row_columns = view.row_columns
    work = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    try:
        src = work / "src"
        copy_parts(store, keys, src)
        files = [str(src / k) for k in keys]
        nbytes = sum(os.path.getsize(f) for f in files)
        engines: dict[str, Callable[[Path], None]] = {
            "ours": lambda out: _ours(src, keys, out, since, schema),
            "duckdb": lambda out: _duckdb(files, out, since, row_columns),
            "polars": lambda out: _polars(files, out, since, row_columns),
        }
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
        names = list(engines)
        for rep in range(reps):
            # Each rep in another order: no engine always runs first (or after the same one).
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                run = engines[name]
                out = work / f"{name}-{rep}"
                out.mkdir()
                c0, w0 = time.process_time(), time.perf_counter()
                run(out)
                runs[name].append((time.perf_counter() - w0, time.process_time() - c0))
        columns = [*row_columns, ERROR, TIME, DIFF]
        ours = _contents(work / f"ours-{reps - 1}", columns)
        for name in ("duckdb", "polars"):
            theirs = _contents(work / f"{name}-{reps - 1}", columns)
            if not ours.equals(theirs):
                raise AssertionError(f"expected {name} to write the updates ours wrote ({ours.num_rows} rows), "
                                     f"found {theirs.num_rows} rows that differ")
        mb = nbytes / 1e6
        out: dict[str, Any] = {"mb": round(mb, 3), "rows_out": ours.num_rows, "reps": reps}
        for name, r in runs.items():
            wall = statistics.median(w for w, _ in r)
            out[f"{name}_mb_per_s"] = round(mb / wall, 2)
            out[f"{name}_cpu_s"] = round(statistics.median(c for _, c in r), 3)
        out["vs_duckdb"] = round(out["ours_mb_per_s"] / out["duckdb_mb_per_s"], 3)
        out["vs_polars"] = round(out["ours_mb_per_s"] / out["polars_mb_per_s"], 3)
        out["cpu_vs_duckdb"] = round(out["duckdb_cpu_s"] / out["ours_cpu_s"], 3) if out["ours_cpu_s"] else None
        out["cpu_vs_polars"] = round(out["polars_cpu_s"] / out["ours_cpu_s"], 3) if out["ours_cpu_s"] else None
        log(f"peers on the same {mb:.1f} MB (local copies, median of {reps}): "
            + ", ".join(f"{n} {out[f'{n}_mb_per_s']} MB/s {out[f'{n}_cpu_s']} CPU-s" for n in engines)
            + f"; ours / duckdb {out['vs_duckdb']}, ours / polars {out['vs_polars']}")
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)
