# vkv's CUDA kernels (csrc/cuda/): compiled by nvcc at build time into one fatbin per
# source (SASS for VKV_CUDA_ARCHITECTURES, PTX of the first for newer GPUs to JIT) and
# embedded in the library as a byte array, which CudaBackend loads with cuModuleLoadData
# on first use. vkv links no CUDA runtime, and the library still loads without a driver.
#
# VKV_CUDA_KERNELS: AUTO builds them where nvcc is found and compiles them (tried once at
# configure time), ON requires that, OFF skips them. Without them the CUDA backend falls
# back to one driver memset per range (slower to enqueue, same result).
# Included from the top-level CMakeLists.txt after the CUDA backend is decided; sets
# VKV_CUDA_KERNELS_ENABLED.

set(VKV_CUDA_KERNELS AUTO CACHE STRING
  "Build vkv's CUDA kernels with nvcc (needs no GPU): AUTO (when nvcc is found and works), ON or OFF")
set_property(CACHE VKV_CUDA_KERNELS PROPERTY STRINGS AUTO ON OFF)
set(VKV_CUDA_ARCHITECTURES "80;90" CACHE STRING
  "GPU architectures the kernels carry machine code for; PTX of the first is embedded too")

string(TOUPPER "${VKV_CUDA_KERNELS}" vkv_kernels_mode)
if(vkv_kernels_mode MATCHES "^(OFF|0|FALSE|NO|N)$")
  set(vkv_kernels_mode OFF)
elseif(NOT vkv_kernels_mode STREQUAL "AUTO")
  set(vkv_kernels_mode ON)
endif()

set(VKV_CUDA_KERNELS_ENABLED OFF)
if(NOT VKV_CUDA_ENABLED)
  if(vkv_kernels_mode STREQUAL "ON")
    message(FATAL_ERROR "VKV_CUDA_KERNELS=ON needs the CUDA backend, which is off (VKV_WITH_CUDA, cuda.h)")
  endif()
  return()
endif()
if(vkv_kernels_mode STREQUAL "OFF")
  message(STATUS "vkv: CUDA kernels off (VKV_CUDA_KERNELS=OFF): zero_strided() uses driver memsets")
  return()
endif()

get_filename_component(vkv_cuda_root "${VKV_CUDA_INCLUDE_DIR}" DIRECTORY)
find_program(VKV_NVCC nvcc
  HINTS "${vkv_cuda_root}/bin" ENV CUDA_HOME ENV CUDA_PATH
  PATH_SUFFIXES bin
  PATHS /usr/local/cuda /opt/cuda)

list(GET VKV_CUDA_ARCHITECTURES 0 vkv_ptx_architecture)
set(vkv_nvcc_flags --fatbin -O3 -ccbin "${CMAKE_CXX_COMPILER}")
foreach(architecture IN LISTS VKV_CUDA_ARCHITECTURES)
  list(APPEND vkv_nvcc_flags -gencode "arch=compute_${architecture},code=sm_${architecture}")
endforeach()
list(APPEND vkv_nvcc_flags -gencode "arch=compute_${vkv_ptx_architecture},code=compute_${vkv_ptx_architecture}")

# One trial compile at configure time, so that an nvcc too old for the architectures or
# without a usable host compiler turns AUTO off here instead of failing the build.
set(vkv_kernel_sources zero_fill)
set(vkv_nvcc_trial "${VKV_NVCC}|${vkv_nvcc_flags}")
if(VKV_NVCC AND NOT vkv_nvcc_trial STREQUAL VKV_NVCC_WORKED_WITH)
  file(MAKE_DIRECTORY "${PROJECT_BINARY_DIR}/cuda_kernels")
  execute_process(
    COMMAND "${VKV_NVCC}" ${vkv_nvcc_flags} -o "${PROJECT_BINARY_DIR}/cuda_kernels/trial.fatbin"
            "${PROJECT_SOURCE_DIR}/csrc/cuda/zero_fill.cu"
    RESULT_VARIABLE vkv_nvcc_result OUTPUT_VARIABLE vkv_nvcc_output ERROR_VARIABLE vkv_nvcc_output)
  if(vkv_nvcc_result EQUAL 0)
    set(VKV_NVCC_WORKED_WITH "${vkv_nvcc_trial}" CACHE INTERNAL "nvcc and flags that compiled the kernels")
  else()
    set(vkv_nvcc_failure "${VKV_NVCC} failed to compile csrc/cuda/zero_fill.cu:\n${vkv_nvcc_output}")
  endif()
elseif(NOT VKV_NVCC)
  set(vkv_nvcc_failure "nvcc was not found (looked in ${vkv_cuda_root}/bin, CUDA_HOME, CUDA_PATH, PATH)")
endif()
if(DEFINED vkv_nvcc_failure)
  if(vkv_kernels_mode STREQUAL "ON")
    message(FATAL_ERROR "VKV_CUDA_KERNELS=ON, but ${vkv_nvcc_failure}\nSet VKV_NVCC to a working nvcc, "
                        "or configure with -DVKV_CUDA_KERNELS=AUTO (or OFF)")
  endif()
  message(NOTICE "vkv: building without CUDA kernels: ${vkv_nvcc_failure}\nThe CUDA backend zero-fills "
                 "with one driver memset per range instead (set VKV_NVCC to a working nvcc to build them).")
  return()
endif()

set(VKV_CUDA_KERNELS_ENABLED ON)
message(STATUS "vkv: CUDA kernels on, nvcc ${VKV_NVCC}, architectures ${VKV_CUDA_ARCHITECTURES} "
               "(+ PTX ${vkv_ptx_architecture})")
foreach(kernel IN LISTS vkv_kernel_sources)
  set(fatbin "${PROJECT_BINARY_DIR}/cuda_kernels/${kernel}.fatbin")
  set(embedded "${PROJECT_BINARY_DIR}/cuda_kernels/${kernel}_fatbin.cpp")
  add_custom_command(OUTPUT "${fatbin}"
    COMMAND "${VKV_NVCC}" ${vkv_nvcc_flags} -o "${fatbin}" "${PROJECT_SOURCE_DIR}/csrc/cuda/${kernel}.cu"
    DEPENDS "${PROJECT_SOURCE_DIR}/csrc/cuda/${kernel}.cu"
    COMMENT "nvcc: csrc/cuda/${kernel}.cu -> ${kernel}.fatbin"
    VERBATIM)
  add_custom_command(OUTPUT "${embedded}"
    COMMAND "${CMAKE_COMMAND}" "-DINPUT=${fatbin}" "-DOUTPUT=${embedded}" "-DSYMBOL=${kernel}_fatbin"
            -P "${PROJECT_SOURCE_DIR}/cmake/embed_binary.cmake"
    DEPENDS "${fatbin}" "${PROJECT_SOURCE_DIR}/cmake/embed_binary.cmake"
    COMMENT "embedding ${kernel}.fatbin"
    VERBATIM)
  target_sources(vkv PRIVATE "${embedded}")
endforeach()
target_compile_definitions(vkv PRIVATE VKV_CUDA_KERNELS=1)
