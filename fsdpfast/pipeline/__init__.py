"""One merge, step by step: plan (pipeline.plan), job (pipeline.job: layout, engine, target), the
processes that write it (pipeline.processes), the small files (pipeline.finish) and the reports
(pipeline.report). The public functions (fsdpfast.api) compose these from MergeOptions (fsdpfast.options)."""
