"""flashjax.info(): the build, the devices seen, and which kernels a call would run
(for bug reports: `python -c "import flashjax, pprint; pprint.pprint(flashjax.info())"`)."""

from __future__ import annotations

import ctypes
import importlib.metadata

import jax
import jax.numpy as jnp

from . import _ffi, _fp8, _route
from ._visibility import Window

DTYPES = {jnp.dtype(jnp.float32): 0, jnp.dtype(jnp.float16): 1, jnp.dtype(jnp.bfloat16): 2}
NAME_BYTES = 32


def version() -> str:
    try:
        return importlib.metadata.version("flashjax")
    except importlib.metadata.PackageNotFoundError:  # imported from a source tree
        return "unknown"


class _CallDescription(ctypes.Structure):  # csrc/ffi/introspection.h
    _fields_ = ([("dtype", ctypes.c_int32)]
                + [(n, ctypes.c_int64) for n in ("batch", "seqlen_q", "seqlen_k", "heads_q",
                                                  "heads_kv", "head_dim", "head_dim_v",
                                                  "window_left", "window_right")]
                + [(n, ctypes.c_int32) for n in ("packed", "seqused", "segment_ids",
                                                  "positions", "kv_cache", "deterministic",
                                                  "kernel_cap", "score_terms", "float8")])


def _build() -> dict:
    lib = _ffi.library()
    lib.FlashjaxBuildInfo.restype = ctypes.c_char_p
    fields = dict(item.split("=", 1) for item in lib.FlashjaxBuildInfo().decode().split(";"))
    split = lambda s: [x for x in s.split(",") if x]
    return {"cuda_targets": split(fields["cuda_targets"]),
            "head_dim_buckets": [int(x) for x in split(fields["head_dims"])],
            "cuda_runtime": fields["cuda_runtime"] or None}


def _cuda_kernels(device, call: _CallDescription) -> dict:
    lib = _ffi.library()
    forward, backward = (ctypes.create_string_buffer(NAME_BYTES) for _ in range(2))
    status = lib.FlashjaxKernelChoice(device.local_hardware_id, ctypes.byref(call), forward,
                                      backward, NAME_BYTES)
    if status != 0:
        return {"forward": f"unknown (CUDA error {status})", "backward": "unknown"}
    return {"forward": forward.value.decode(), "backward": backward.value.decode()}


def _kernels(device, call: _CallDescription, backend: str) -> dict:
    """The kernels `device` would run for the call."""
    platform = device.platform
    cuda = platform == "gpu" and "CUDA" in _ffi.load() and "rocm" not in str(
        getattr(device.client, "platform_version", "")).lower()
    if backend == "xla" or (backend == "auto" and not (cuda or platform == "cpu")):
        return {"forward": "xla", "backward": "xla"}
    if backend == "cpu" or (backend == "auto" and platform == "cpu"):
        if platform != "cpu":
            return {"forward": "unavailable", "backward": "unavailable"}
        return {"forward": "cpu", "backward": "none" if call.kv_cache else "cpu"}
    if not cuda:
        return {"forward": "unavailable", "backward": "unavailable"}
    return _cuda_kernels(device, call)


def info(q=None, k=None, v=None, *, causal=False, window_size=(-1, -1), deterministic=False,
         implementation=None, seqused=False, segment_ids=False, positions=False,
         varlen=False, kv_cache=False, score_terms=False) -> dict:
    """The flashjax build and the devices JAX sees; given a call (q, k, v: arrays or
    jax.ShapeDtypeStruct in flash_attention's (batch, seqlen, heads, head_dim) layout,
    and its options: the flags say which metadata it passes; score_terms: a bias, mask,
    alibi_slopes or dropout), also the kernels each device would run for its forward and
    backward."""
    result = {"version": version(), "jax": jax.__version__,
              "platforms": sorted(_ffi.load()), **_build(),
              "devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in _all_devices()]}
    if q is None:
        return result
    if k is None or v is None:
        raise ValueError("info() describes a call by q, k and v together")
    fields = _route.implementation_fields(implementation)
    window = Window.of(causal, window_size)
    float8 = _fp8.ELEMENT_CODES.get(jnp.dtype(q.dtype), 0)  # (out: bfloat16; "none": dequantised)
    call = _call_description(
        q, k, v, window, jnp.bfloat16 if float8 else q.dtype, packed=int(varlen),
        seqused=int(seqused), segment_ids=int(segment_ids), positions=int(positions),
        kv_cache=int(kv_cache), deterministic=int(deterministic),
        kernel_cap=fields["kernel_cap"], score_terms=int(score_terms), float8=float8)
    result["kernels"] = {f"{d.platform}:{d.id}": _kernels(d, call, fields["implementation"])
                         for d in _all_devices()}
    if float8:  # (forward only)
        result["kernels"] = {d: dict(k, backward="none") for d, k in result["kernels"].items()}
    return result


def float8_kernel_runs(q, k, v, window: Window, out_dtype) -> bool:
    """Whether every CUDA device JAX has would run flash_attention's float8 call (float8
    q, k, v; out in out_dtype) on the Hopper kernel, reading the float8 values itself
    (else flash_attention dequantises them)."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return False
    if not gpus or "CUDA" not in _ffi.load():
        return False
    call = _call_description(q, k, v, window, out_dtype,
                             float8=_fp8.ELEMENT_CODES[jnp.dtype(q.dtype)])
    return all(_cuda_kernels(d, call)["forward"] == "hopper" for d in gpus)


def _call_description(q, k, v, window: Window, dtype, **flags) -> _CallDescription:
    """The call of q, k, v (flash_attention's layout) with `window`, in `dtype` (its
    kernels' dtype: q's, or out's for float8 q), and the flags given."""
    return _CallDescription(
        dtype=DTYPES.get(jnp.dtype(dtype), 0), batch=q.shape[0], seqlen_q=q.shape[1],
        seqlen_k=k.shape[1], heads_q=q.shape[2], heads_kv=k.shape[2], head_dim=q.shape[3],
        head_dim_v=v.shape[3], window_left=window.left, window_right=window.right, **flags)


def _all_devices() -> list:
    devices = []
    for backend in ("gpu", "tpu", "cpu"):
        try:
            devices += jax.devices(backend)
        except RuntimeError:
            continue
    return devices
