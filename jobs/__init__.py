"""llmq.jobs: datasets in, datasets out: templates, multi-stage pipelines, dedup (`llmq run`).

A layer over the broker's producer side: it imports llmq.protocol and llmq.broker, never the
worker (torch), the gateway or the CLI. Modules, one concept each:

- spec.py: JobSpec, a job file's (or the command line's) source, output, stages and dedup
- sources.py: DatasetSource, rows of JSONL / CSV / Parquet / Arrow / folders / datasets, in order
- templates.py: RequestTemplate and Condition, sandboxed Jinja over a row's columns
- dedup.py: NearDuplicates, MinHash LSH over one column
- sinks.py: RowWriter, output and errors in input order, resumable, converted at the end
- pipeline.py: DatasetJob, the rows through the stages on an OrderedRun
- progress.py: DatasetProgress, per-stage rows, tokens/s and ETA (and the job store's record)
"""
