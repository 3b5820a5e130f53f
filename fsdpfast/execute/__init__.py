"""Stage 3, execution: engines turn a plan's extents into output bytes; the writer runs them in
batches over the output files."""
