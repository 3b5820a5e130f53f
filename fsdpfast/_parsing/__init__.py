"""Parsing helpers the readers share (private): the restricted unpickler, torch.save zip archives
and safetensors headers. Byte formats only: where a piece lands is geometry/, reader logic readers/."""
