"""The plan's checks that read tensor bytes, through a Source (io.sources), before any byte is written.

plan/ decides from metadata alone; what only the data can tell is checked here: copies the
checkpoint holds twice agree with the one read (copies), names config.json ties hold the same
values before one is dropped (ties). Both read a window at a time (tensor_bytes).
"""
