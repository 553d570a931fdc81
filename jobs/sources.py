"""DatasetSource: the rows of a dataset, in order, one at a time.

    source = open_source(SourceSpec("docs.parquet", max_rows=1000))
    source.num_rows          # known up front (progress and ETA), None when it is not
    for row in source.rows():  # dicts of column -> value, or BadRow for a line that is not one
        ...

What a path can be, by its extension: JSONL (.jsonl, .ndjson, .json: one object per line), CSV
(.csv, .tsv; every value a string), Parquet (.parquet, .pq), Arrow IPC (.arrow, .feather, .ipc:
file or stream format); a folder of such files (read in name order); a folder written by
`datasets.save_to_disk` (`--split` picks one of a DatasetDict's splits); else a Hugging Face
dataset id, loaded with `datasets.load_dataset(id, subset, split=split)` (offline it reads the
local cache: HF_DATASETS_OFFLINE=1). Parquet, Arrow and datasets are read a record batch at a
time, so memory does not grow with the dataset. pyarrow and datasets are imported only for the
formats that need them (`pip install 'llmq[datasets]'`).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

from llmq.jobs.spec import SourceSpec
from llmq.jobs.templates import SpecError

__all__ = ["BadRow", "DatasetSource", "open_source"]

JSONL_EXTENSIONS = (".jsonl", ".ndjson", ".json")
CSV_EXTENSIONS = (".csv", ".tsv")
PARQUET_EXTENSIONS = (".parquet", ".pq")
ARROW_EXTENSIONS = (".arrow", ".feather", ".ipc")
EXTENSIONS = JSONL_EXTENSIONS + CSV_EXTENSIONS + PARQUET_EXTENSIONS + ARROW_EXTENSIONS
_BATCH_ROWS = 1024


@dataclass(frozen=True)
class BadRow:
    """A row of the input that is not one (a JSONL line that is not a JSON object)."""

    reason: str


Row = dict[str, Any] | BadRow


@dataclass
class DatasetSource:
    description: str  # what is read, for messages
    num_rows: int | None
    _rows: Callable[[], Iterator[Row]]
    max_rows: int | None = None

    def rows(self) -> Iterator[Row]:
        rows = self._rows()
        return rows if self.max_rows is None else islice(rows, self.max_rows)


def _need_pyarrow() -> Any:
    try:
        import pyarrow
    except ImportError:
        raise SpecError("Parquet and Arrow need pyarrow: pip install 'llmq[datasets]'") from None
    return pyarrow


def _jsonl(path: str) -> DatasetSource:
    def rows() -> Iterator[Row]:
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as exc:
                    yield BadRow(f"{os.path.basename(path)} line {number}: not JSON: {exc}")
                    continue
                if not isinstance(value, dict):
                    yield BadRow(f"{os.path.basename(path)} line {number}: not a JSON object")
                    continue
                yield value

    with open(path, "rb") as f:
        num_rows = sum(1 for line in f if line.strip())
    return DatasetSource(path, num_rows, rows)


def _csv(path: str) -> DatasetSource:
    delimiter = "\t" if path.endswith(".tsv") else ","

    def rows() -> Iterator[Row]:
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            yield from csv.DictReader(f, delimiter=delimiter)

    return DatasetSource(path, sum(1 for _ in rows()), rows)


def _parquet(path: str) -> DatasetSource:
    _need_pyarrow()
    import pyarrow.parquet as pq

    def rows() -> Iterator[Row]:
        with pq.ParquetFile(path) as parquet:
            for batch in parquet.iter_batches(batch_size=_BATCH_ROWS):
                yield from batch.to_pylist()

    with pq.ParquetFile(path) as parquet:
        num_rows = parquet.metadata.num_rows
    return DatasetSource(path, num_rows, rows)


def _arrow_reader(path: str) -> Any:
    pa = _need_pyarrow()
    source = pa.memory_map(path)
    try:
        return pa.ipc.open_file(source)
    except pa.ArrowInvalid:  # not the file format: the stream format (what datasets writes)
        source.seek(0)
        return pa.ipc.open_stream(source)


def _arrow(path: str) -> DatasetSource:
    pa = _need_pyarrow()

    def batches() -> Iterator[Any]:
        reader = _arrow_reader(path)
        if isinstance(reader, pa.ipc.RecordBatchFileReader):
            yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            yield from reader

    def rows() -> Iterator[Row]:
        for batch in batches():
            for start in range(0, batch.num_rows, _BATCH_ROWS):
                yield from batch.slice(start, _BATCH_ROWS).to_pylist()

    return DatasetSource(path, sum(batch.num_rows for batch in batches()), rows)


def _file(path: str) -> DatasetSource:
    lower = path.lower()
    for extensions, opener in ((JSONL_EXTENSIONS, _jsonl), (CSV_EXTENSIONS, _csv),
                               (PARQUET_EXTENSIONS, _parquet), (ARROW_EXTENSIONS, _arrow)):
        if lower.endswith(extensions):
            return opener(path)
    raise SpecError(f"{path}: unknown format (extensions read: {', '.join(EXTENSIONS)})")


def _datasets_rows(dataset: Any) -> Iterator[Row]:
    for batch in dataset.iter(batch_size=_BATCH_ROWS):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns), strict=True):
            yield dict(zip(columns, values, strict=True))


def _pick_split(dataset: Any, split: str | None, what: str) -> Any:
    if not hasattr(dataset, "keys"):  # a Dataset, not a DatasetDict
        return dataset
    splits = list(dataset.keys())
    if split is None:
        if len(splits) != 1:
            raise SpecError(f"{what} has splits {', '.join(splits)}: pick one with --split")
        split = splits[0]
    if split not in dataset:
        raise SpecError(f"{what} has no split {split!r} (it has {', '.join(splits)})")
    return dataset[split]


def _need_datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise SpecError("this source needs the datasets library: "
                        "pip install 'llmq[datasets]'") from None
    return datasets


def _saved_dataset(path: str, split: str | None) -> DatasetSource:
    datasets = _need_datasets()
    dataset = _pick_split(datasets.load_from_disk(path), split, path)
    return DatasetSource(path, len(dataset), lambda: _datasets_rows(dataset))


def _hub_dataset(spec: SourceSpec) -> DatasetSource:
    datasets = _need_datasets()
    try:
        loaded = datasets.load_dataset(spec.path, spec.subset, split=spec.split)
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds; all mean "cannot load"
        raise SpecError(f"{spec.path}: no such file or folder, and not a dataset datasets can "
                        f"load ({type(exc).__name__}: {exc})") from None
    dataset = _pick_split(loaded, None, spec.path)
    what = spec.path + (f" ({spec.subset})" if spec.subset else "")
    return DatasetSource(what, len(dataset), lambda: _datasets_rows(dataset))


def _folder(path: str, split: str | None) -> DatasetSource:
    names = set(os.listdir(path))
    if names & {"dataset_dict.json", "state.json"}:
        return _saved_dataset(path, split)
    files = sorted(os.path.join(folder, name) for folder, _, names_ in os.walk(path)
                   for name in names_ if name.lower().endswith(EXTENSIONS))
    if not files:
        raise SpecError(f"{path}: a folder with no {', '.join(EXTENSIONS)} files")
    parts = [_file(file) for file in files]

    def rows() -> Iterator[Row]:
        for part in parts:
            yield from part.rows()

    total = sum(part.num_rows or 0 for part in parts)
    return DatasetSource(f"{path} ({len(files)} files)", total, rows)


def open_source(spec: SourceSpec) -> DatasetSource:
    """The rows `spec` names; SpecError when it names nothing readable."""
    if os.path.isdir(spec.path):
        source = _folder(spec.path, spec.split)
    elif os.path.isfile(spec.path):
        source = _file(spec.path)
    elif spec.path.lower().endswith(EXTENSIONS):  # a file name, not a dataset id: say so
        raise SpecError(f"{spec.path}: no such file")
    else:
        source = _hub_dataset(spec)
    if spec.max_rows is not None:
        source.max_rows = spec.max_rows
        if source.num_rows is not None:
            source.num_rows = min(source.num_rows, spec.max_rows)
    return source
