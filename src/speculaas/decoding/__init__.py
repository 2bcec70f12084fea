from .autoregressive import autoregressive_decode
from .jacobi import jacobi_decode
from .result import DecodeResult

__all__ = ["DecodeResult", "autoregressive_decode", "jacobi_decode"]
