# Configures and builds the library as on a machine without the CUDA toolkit: cuda.h is
# hidden from every search path. With VKV_WITH_CUDA=AUTO (the default) configure must
# succeed, say so, and build the host backend alone; with VKV_WITH_CUDA=ON it must fail.
# Then as on one with cuda.h but no working nvcc (VKV_NVCC names none): AUTO builds the
# CUDA backend without its kernels, VKV_CUDA_KERNELS=ON fails with a message.
file(REMOVE_RECURSE ${WORK_DIR})
set(hidden "/usr/local/cuda/include;/opt/cuda/include;/usr/include;/usr/local/include")
if(DEFINED ENV{CUDA_HOME})
  list(APPEND hidden "$ENV{CUDA_HOME}/include")
endif()
if(DEFINED ENV{CUDA_PATH})
  list(APPEND hidden "$ENV{CUDA_PATH}/include")
endif()
set(configure ${CMAKE_COMMAND} -E env --unset=CUDA_HOME --unset=CUDA_PATH
    ${CMAKE_COMMAND} -S ${SOURCE_DIR} -G Ninja -DVKV_BUILD_TESTS=OFF -DVKV_BUILD_EXAMPLES=OFF
    -DVKV_BUILD_BENCHMARKS=OFF -DVKV_BUILD_PYTHON=OFF "-DCMAKE_IGNORE_PATH=${hidden}")

execute_process(COMMAND ${configure} -B ${WORK_DIR}/auto RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "configure without cuda.h failed (${result}):\n${out}\n${err}")
endif()
if(NOT "${out}${err}" MATCHES "cuda.h not found.*building without the CUDA backend")
  message(FATAL_ERROR "configure without cuda.h did not say it builds without CUDA:\n${out}\n${err}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/auto --target vkv RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "building the host-only library failed (${result})")
endif()

execute_process(COMMAND ${configure} -B ${WORK_DIR}/on -DVKV_WITH_CUDA=ON RESULT_VARIABLE result
                OUTPUT_QUIET ERROR_VARIABLE err)
if(result EQUAL 0 OR NOT err MATCHES "VKV_WITH_CUDA=ON but cuda.h was not found")
  message(FATAL_ERROR "VKV_WITH_CUDA=ON without cuda.h should fail with a message, got (${result}):\n${err}")
endif()
message(STATUS "no_cuda: AUTO builds the host backend alone; ON fails with a message")

if(NOT CUDA_HEADERS_FOUND)
  return()  # this machine has no cuda.h either: nothing more to pretend
endif()
set(configure ${CMAKE_COMMAND} -S ${SOURCE_DIR} -G Ninja -DVKV_BUILD_TESTS=OFF -DVKV_BUILD_EXAMPLES=OFF
    -DVKV_BUILD_BENCHMARKS=OFF -DVKV_BUILD_PYTHON=OFF -DVKV_NVCC=${WORK_DIR}/no-such-nvcc)
execute_process(COMMAND ${configure} -B ${WORK_DIR}/no_nvcc RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT result EQUAL 0 OR NOT "${out}${err}" MATCHES "building without CUDA kernels")
  message(FATAL_ERROR "configure without a working nvcc should build without kernels, got (${result}):\n${out}\n${err}")
endif()
# The CUDA backend's memset-only side compiles (the full library builds in the main build).
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/no_nvcc --target CMakeFiles/vkv.dir/src/backends/cuda_backend.cpp.o
                RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "compiling the CUDA backend without kernels failed (${result})")
endif()
execute_process(COMMAND ${configure} -B ${WORK_DIR}/no_nvcc_on -DVKV_CUDA_KERNELS=ON RESULT_VARIABLE result
                OUTPUT_QUIET ERROR_VARIABLE err)
if(result EQUAL 0 OR NOT err MATCHES "VKV_CUDA_KERNELS=ON, but")
  message(FATAL_ERROR "VKV_CUDA_KERNELS=ON without nvcc should fail with a message, got (${result}):\n${err}")
endif()
message(STATUS "no_cuda: without nvcc, AUTO builds the CUDA backend without kernels; ON fails with a message")
