"""Private (not API): real sharded checkpoints written by real torch.distributed / DeepSpeed / framework
code, for the demo and the tests. Not used by a merge."""
