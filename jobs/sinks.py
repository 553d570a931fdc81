"""RowWriter: a job's output rows and error rows, in input order, resumable after a kill.

Every row the job finishes goes to exactly one of two JSONL files, one flushed line at a time,
in input order, each line carrying its source row number (`llmq_row`): the output (the row's
columns and its result columns) or the errors file (`{"llmq_row", "stage", "id", "error":
{"code", "message"}}`). So after a kill both files hold whole lines up to some row (a line cut
short is dropped), and `resume()` returns the last row written: the job goes on after it.

The output's format follows its extension. JSONL is written in place. CSV, Parquet and Arrow
cannot be appended to after a kill (Parquet's footer comes last), so rows go to a journal,
`OUTPUT.partial.jsonl`, and `finish()` converts it a chunk of rows at a time (Parquet row groups,
Arrow record batches) into OUTPUT, then deletes it: an OUTPUT with no journal beside it is a
finished job. Nested values (usage, parsed JSON) become Arrow structs and lists, or JSON text in
a CSV cell.
"""

from __future__ import annotations

import base64
import csv
import datetime
import decimal
import json
import os
from collections.abc import Iterator
from typing import Any, TextIO

__all__ = ["ROW_COLUMN", "RowWriter", "write_converted"]

ROW_COLUMN = "llmq_row"  # the source row number (0-based) of every output and error line
CONVERTED_EXTENSIONS = {".csv": "csv", ".tsv": "csv", ".parquet": "parquet", ".pq": "parquet",
                        ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow"}
# NOTE: JSON allows U+2028 and U+2029 raw inside strings; escaped, no JSONL reader splits a row.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})
_CONVERT_ROWS = 10_000


def _jsonable(value: Any) -> Any:
    """Column values JSON has no type for (Parquet timestamps, binary, decimals)."""
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, decimal.Decimal):
        return str(value)
    raise TypeError(f"a value of type {type(value).__name__} cannot be written")


def dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=False, default=_jsonable).translate(_LINE_BREAKS)


def _last_row(path: str) -> tuple[int, int, int]:
    """(last row number or -1, byte length of the whole lines, number of lines) of a JSONL
    file this writer wrote; a last line cut short by a kill does not count."""
    last, good, count = -1, 0, 0
    if not os.path.exists(path):
        return last, good, count
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            try:
                row = json.loads(raw)[ROW_COLUMN]
            except (ValueError, KeyError, TypeError):
                break
            last, good, count = row, good + len(raw), count + 1
    return last, good, count


def _open_truncated(path: str, length: int) -> TextIO:
    stream = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - closed by RowWriter.close
    stream.truncate(length)
    stream.seek(0, os.SEEK_END)
    return stream


class RowWriter:
    def __init__(self, output: str, errors: str) -> None:
        self.output = output
        self.errors = errors
        ext = os.path.splitext(output)[1].lower()
        self.format = CONVERTED_EXTENSIONS.get(ext, "jsonl")
        self.journal = output if self.format == "jsonl" else f"{output}.partial.jsonl"
        self.num_rows = 0  # output lines, earlier runs' included
        self.num_errors = 0  # error lines, earlier runs' included
        self._out: TextIO | None = None
        self._err: TextIO | None = None

    @property
    def finished_before(self) -> bool:
        """A converted output with no journal: an earlier run finished the job."""
        return (self.format != "jsonl" and os.path.exists(self.output)
                and not os.path.exists(self.journal))

    def resume(self) -> int:
        """Open both files after their whole lines; the last source row written (-1: none)."""
        last_out, out_length, self.num_rows = _last_row(self.journal)
        last_err, err_length, self.num_errors = _last_row(self.errors)
        for path in (self.journal, self.errors):
            folder = os.path.dirname(os.path.abspath(path))
            os.makedirs(folder, exist_ok=True)
        self._out = _open_truncated(self.journal, out_length)
        self._err = _open_truncated(self.errors, err_length)
        return max(last_out, last_err)

    def write_row(self, record: dict[str, Any]) -> None:
        assert self._out is not None, "resume() first"
        self._out.write(dumps(record) + "\n")
        self._out.flush()
        self.num_rows += 1

    def write_error(self, record: dict[str, Any]) -> None:
        assert self._err is not None, "resume() first"
        self._err.write(dumps(record) + "\n")
        self._err.flush()
        self.num_errors += 1

    def close(self) -> None:
        for stream in (self._out, self._err):
            if stream is not None:
                stream.close()
        self._out = self._err = None

    def finish(self) -> None:
        """Every row is written: convert the journal into OUTPUT (CSV, Parquet, Arrow)."""
        self.close()
        if self.format == "jsonl":
            return
        temporary = f"{self.output}.tmp"
        write_converted(self.journal, temporary, self.format)
        os.replace(temporary, self.output)  # NOTE: atomic: OUTPUT is whole or absent
        os.remove(self.journal)


def _chunks(path: str) -> Iterator[list[dict[str, Any]]]:
    with open(path, encoding="utf-8") as f:
        chunk: list[dict[str, Any]] = []
        for line in f:
            chunk.append(json.loads(line))
            if len(chunk) == _CONVERT_ROWS:
                yield chunk
                chunk = []
        if chunk:
            yield chunk


def write_converted(journal: str, path: str, fmt: str) -> None:
    """JSONL rows -> CSV, Parquet or Arrow at `path`, one chunk of rows in memory at a time."""
    if fmt == "csv":
        _write_csv(journal, path)
        return
    import pyarrow as pa

    # NOTE: two passes: a column may be null in the first chunk and text in a later one, so the
    # schema is every chunk's unified before anything is written.
    schema: Any = None
    for chunk in _chunks(journal):
        inferred = pa.Table.from_pylist(chunk).schema
        schema = inferred if schema is None else pa.unify_schemas(
            [schema, inferred], promote_options="permissive")
    if schema is None:
        schema = pa.schema([(ROW_COLUMN, pa.int64())])
    if fmt == "parquet":
        import pyarrow.parquet as pq

        writer: Any = pq.ParquetWriter(path, schema)
    else:
        writer = pa.ipc.new_file(path, schema)
    try:
        for chunk in _chunks(journal):
            writer.write_table(pa.Table.from_pylist(chunk, schema=schema))
    finally:
        writer.close()


def _write_csv(journal: str, path: str) -> None:
    columns: dict[str, None] = {}  # every column, in first-seen order
    for chunk in _chunks(journal):
        for record in chunk:
            columns.update(dict.fromkeys(record))
    delimiter = "\t" if path.endswith(".tsv.tmp") else ","
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), delimiter=delimiter)
        writer.writeheader()
        for chunk in _chunks(journal):
            writer.writerows({k: json.dumps(v, ensure_ascii=False)
                              if isinstance(v, dict | list) else v for k, v in record.items()}
                             for record in chunk)
