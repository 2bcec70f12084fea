"""speculaas: fast autoregressive image generation with content-aware speculative decoding."""

from . import acceptance
from .api import METHODS, GenerationOutput, generate
from .config import JacobiConfig, SamplingConfig
from .models import load_model

__version__ = "0.1.0"
__all__ = ["METHODS", "GenerationOutput", "JacobiConfig", "SamplingConfig", "acceptance",
           "generate", "load_model"]
