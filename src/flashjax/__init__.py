"""flashjax: exact, fast FlashAttention for JAX (C++/CUDA kernels via the XLA FFI)."""

from . import flax, fp8, nn, reference, ring
from ._dropout import dropout_mask
from ._ffi import has_cuda_kernels
from ._introspection import info, version as _version
from .attention import flash_attention, flash_attention_backward, flash_attention_forward
from .kvcache import flash_attention_with_kvcache
from .ring import ring_attention
from .varlen import flash_attention_varlen

__all__ = ["dropout_mask", "flash_attention", "flash_attention_backward", "flash_attention_forward",
           "flash_attention_varlen", "flash_attention_with_kvcache", "fp8",
           "has_cuda_kernels", "info", "reference", "ring", "ring_attention"]
# flashjax.nn and flashjax.flax are attributes but not in __all__: a star import would
# shadow `flax` and the customary `import flax.linen as nn`.
__version__ = _version()  # the installed distribution's (pyproject.toml)
