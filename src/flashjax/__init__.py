"""flashjax: exact, fast FlashAttention for JAX (C++/CUDA kernels via the XLA FFI)."""

from . import reference
from ._ffi import has_cuda_kernels
from .attention import flash_attention

__all__ = ["flash_attention", "has_cuda_kernels", "reference"]
__version__ = "0.1.0"
