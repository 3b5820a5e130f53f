"""Stage 3, execution: engines turn a plan's extents into output bytes.

- writer.execute(plan, files, target, engine=...): any set of output files, or byte ranges of
  them (parts.FilePart), written into a Target; the CRC-32C of every piece written.
- runner.run: the one loop (batches, progress, page release) that feeds a sink;
  sinks.Sink: what every engine's file output is, and compare.CompareSink (verify --against).
- engines.select_engine: cpu (cpu.py), cuda (cuda.py) or torch (torch_engine.py, around
  torch_copy.py, the reference); fallback.py fills the pieces no fast path handles.
"""
