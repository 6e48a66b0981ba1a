# The CUDA kernels and the "CUDA" FFI handlers, added to flashjax_ffi.
# FLASHJAX_CUDA_ARCHS picks the GPU targets: 90a (Hopper: H100/H200) and/or 80
# (Ampere and anything newer through the SIMT/mma.sync paths).
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
set(CMAKE_CUDA_RUNTIME_LIBRARY Static)
# The architectures are passed as explicit -gencode flags below.
set_target_properties(flashjax_ffi PROPERTIES CUDA_ARCHITECTURES OFF)

target_sources(flashjax_ffi PRIVATE
  csrc/cuda/launch.cu
  csrc/cuda/sequence_layout.cu
  csrc/cuda/simt_attention.cu
  csrc/cuda/tensor_core_forward.cu
  csrc/cuda/hopper_forward.cu
  csrc/cuda/kvcache_attention.cu
  csrc/cuda/sm90/bwd_launch.cu
  csrc/cuda/tensor_core_backward.cu
  csrc/ffi/cuda_handlers.cc)
target_link_libraries(flashjax_ffi PRIVATE CUDA::cudart_static)

set(_gencode "")
if("90a" IN_LIST FLASHJAX_CUDA_ARCHS)
  target_compile_definitions(flashjax_ffi PRIVATE FLASHJAX_HOPPER=1)
endif()
foreach(arch IN LISTS FLASHJAX_CUDA_ARCHS)
  string(REGEX REPLACE "[^0-9]" "" _num "${arch}")
  list(APPEND _gencode "-gencode=arch=compute_${arch},code=sm_${arch}")
  message(STATUS "flashjax: compiling CUDA kernels for sm_${arch}")
endforeach()
target_compile_options(flashjax_ffi PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:${_gencode} -O3 -lineinfo
    --expt-relaxed-constexpr -Xcompiler=-fvisibility=hidden>)

foreach(dim IN LISTS FLASHJAX_HEAD_DIMS)
  target_compile_definitions(flashjax_ffi PRIVATE FLASHJAX_TC_HEAD_DIM_${dim}=1)
endforeach()
