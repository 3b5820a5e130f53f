"""fsdpfast: merge sharded training checkpoints into Hugging Face safetensors folders, bit for bit."""

__version__ = "0.1.0"

from .api import MergeReport, inspect, merge, plan_merge  # noqa: E402
from .verify import VerifyReport, verify  # noqa: E402

__all__ = ["merge", "inspect", "plan_merge", "verify", "MergeReport", "VerifyReport", "__version__"]
