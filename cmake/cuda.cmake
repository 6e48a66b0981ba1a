# The CUDA kernels and the "CUDA" FFI handlers, added to flashjax_ffi.
# FLASHJAX_CUDA_ARCHS picks the GPU targets: machine code "NN" (90a: the Hopper
# kernels for H100/H200; 80: the mma.sync and SIMT kernels for Ampere and newer) and
# PTX "NN-virtual" (default 80-virtual: any newer GPU, Blackwell included, JIT-compiles
# the mma.sync and SIMT kernels from it at first use; the Hopper kernels exist only as
# sm_90a machine code and are chosen only on sm_90 devices).
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
set(CMAKE_CUDA_RUNTIME_LIBRARY Static)
# The architectures are passed as explicit -gencode flags below.
set_target_properties(flashjax_ffi PROPERTIES CUDA_ARCHITECTURES OFF)

target_sources(flashjax_ffi PRIVATE
  cuda/launch.cu
  cuda/common/mask_tiles.cu
  cuda/common/sequence_layout.cu
  cuda/simt/simt_attention.cu
  cuda/sm80/tensor_core_forward.cu
  cuda/sm80/tensor_core_backward.cu
  cuda/sm90/fwd_launch.cu
  cuda/sm90/bwd_launch.cu
  cuda/kvcache/kvcache_attention.cu
  ffi/cuda_handlers.cc)
target_link_libraries(flashjax_ffi PRIVATE CUDA::cudart_static)

set(_gencode "")
if("90a" IN_LIST FLASHJAX_CUDA_ARCHS)
  target_compile_definitions(flashjax_ffi PRIVATE FLASHJAX_HOPPER=1)
endif()
# One nvcc pass per virtual architecture, emitting its machine code and/or PTX.
set(_virtual_archs "")
foreach(entry IN LISTS FLASHJAX_CUDA_ARCHS)
  string(REGEX REPLACE "-virtual$" "" arch "${entry}")
  list(APPEND _virtual_archs "${arch}")
endforeach()
list(REMOVE_DUPLICATES _virtual_archs)
foreach(arch IN LISTS _virtual_archs)
  set(_codes "")
  if("${arch}" IN_LIST FLASHJAX_CUDA_ARCHS)
    list(APPEND _codes "sm_${arch}")
  endif()
  if("${arch}-virtual" IN_LIST FLASHJAX_CUDA_ARCHS)
    list(APPEND _codes "compute_${arch}")
  endif()
  list(LENGTH _codes _count)
  string(REPLACE ";" "," _codes "${_codes}")
  if(_count GREATER 1)
    set(_codes "[${_codes}]")  # (one front-end pass for both)
  endif()
  list(APPEND _gencode "-gencode=arch=compute_${arch},code=${_codes}")
  message(STATUS "flashjax: CUDA kernels for compute_${arch}: ${_codes}")
endforeach()
target_compile_options(flashjax_ffi PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:${_gencode} -O3 -lineinfo
    --expt-relaxed-constexpr -Xcompiler=-fvisibility=hidden>)

# What flashjax.info() reports (csrc/ffi/introspection.cc).
string(REPLACE ";" "," _archs_info "${FLASHJAX_CUDA_ARCHS}")
string(REPLACE ";" "," _dims_info "${FLASHJAX_HEAD_DIMS}")
target_compile_definitions(flashjax_ffi PRIVATE FLASHJAX_WITH_CUDA=1
  FLASHJAX_BUILD_CUDA_ARCHS="${_archs_info}" FLASHJAX_BUILD_HEAD_DIMS="${_dims_info}")

foreach(dim IN LISTS FLASHJAX_HEAD_DIMS)
  target_compile_definitions(flashjax_ffi PRIVATE FLASHJAX_TC_HEAD_DIM_${dim}=1)
endforeach()

# The tensor-core kernels of each head-dim bucket in a translation unit of their own,
# generated from launch_bucket.cu.in for the compiled buckets (each kind: the header
# with its launch struct (BucketLaunch unless said), the namespace (the kind's unless
# said), the buckets: the Hopper forward's kBuckets and kFloat8Buckets, fwd_launch.cu,
# and kTensorCoreBuckets, common/dispatch.h, for the others). The Hopper forward's
# float8 kernels (hopper_fp8) compile beside its 16-bit ones, not after them.
set(_bucket_kinds hopper_fwd hopper_fp8 hopper_bwd sm80_fwd sm80_bwd)
set(_header_hopper_fwd cuda/sm90/fwd_launch_bucket.cuh)
set(_header_hopper_fp8 cuda/sm90/fwd_float8_bucket.cuh)
set(_launch_hopper_fp8 Float8BucketLaunch)
set(_namespace_hopper_fp8 hopper_fwd)
set(_header_hopper_bwd cuda/sm90/bwd_launch_bucket.cuh)
set(_header_sm80_fwd cuda/sm80/tensor_core_forward_bucket.cuh)
set(_header_sm80_bwd cuda/sm80/tensor_core_backward_bucket.cuh)
set(_buckets_hopper_fwd 64 96 128 192 256)
set(_buckets_hopper_fp8 128 256)
set(_buckets_hopper_bwd 64 128 256)
set(_buckets_sm80_fwd 64 128 256)
set(_buckets_sm80_bwd 64 128 256)
foreach(kind IN LISTS _bucket_kinds)
  set(HEADER ${_header_${kind}})
  set(NAMESPACE flashjax::cuda::${kind})
  if(DEFINED _namespace_${kind})
    set(NAMESPACE flashjax::cuda::${_namespace_${kind}})
  endif()
  set(LAUNCH BucketLaunch)
  if(DEFINED _launch_${kind})
    set(LAUNCH ${_launch_${kind}})
  endif()
  foreach(DIM IN LISTS _buckets_${kind})
    if(DIM IN_LIST FLASHJAX_HEAD_DIMS)
      set(_unit ${CMAKE_CURRENT_BINARY_DIR}/${kind}_d${DIM}.cu)
      configure_file(${CMAKE_CURRENT_SOURCE_DIR}/cuda/launch_bucket.cu.in ${_unit} @ONLY)
      target_sources(flashjax_ffi PRIVATE ${_unit})
    endif()
  endforeach()
endforeach()
