from .autoregressive import autoregressive_decode
from .loop import decode
from .result import DecodeResult

__all__ = ["DecodeResult", "autoregressive_decode", "decode"]
