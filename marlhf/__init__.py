"""marlhf: RLHF with macro actions (MA-RLHF, ICLR 2025) on Hugging Face models and Accelerate."""

from marlhf import advantages, losses, segments

__version__ = "0.1.0"

__all__ = ["advantages", "losses", "segments", "__version__"]
