"""Parsing helpers the readers share (private): the restricted unpickler, torch.save zip archives,
safetensors headers, and the geometry that turns local pieces into extents. No reader logic here."""
