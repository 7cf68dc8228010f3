# Finds NCCL >= 2.28 (device API) in the CUDA toolkit or in a Python venv's nvidia/nccl package.
# The venv ships only libnccl.so.2; nvcc will not take a versioned .so as an input, so we link
# through a libnccl.so link made in the build tree, beside a libnccl.so.2 link: the binaries' run path
# names that directory, and the loader looks there for the soname, so they load the NCCL whose
# headers they were compiled with (its device API is compiled in) rather than another one on the
# system's path.
set(_nccl_hints "${NCCL_ROOT}" "$ENV{NCCL_ROOT}" "${CUDAToolkit_LIBRARY_ROOT}" "/usr/local/cuda")
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_FOUND)
  execute_process(
    COMMAND ${Python3_EXECUTABLE} -c "import nvidia.nccl as n; print(list(n.__path__)[0])"
    OUTPUT_VARIABLE _nccl_py_root OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_nccl_py_root)
    list(APPEND _nccl_hints "${_nccl_py_root}")
  endif()
endif()

find_path(NCCL_INCLUDE_DIR nccl_device.h HINTS ${_nccl_hints} PATH_SUFFIXES include REQUIRED)
# The library of the same installation as the headers first: a machine may hold several NCCLs (a
# system package beside a Python wheel), and a library of another release than the headers makes
# the device API's kernels fault.
get_filename_component(_nccl_root "${NCCL_INCLUDE_DIR}" DIRECTORY)
find_library(NCCL_LIBRARY_PATH NAMES nccl libnccl.so.2 NAMES_PER_DIR PATHS "${_nccl_root}" PATH_SUFFIXES lib lib64
             NO_DEFAULT_PATH)
find_library(NCCL_LIBRARY_PATH NAMES nccl libnccl.so.2 NAMES_PER_DIR HINTS ${_nccl_hints} PATH_SUFFIXES lib lib64
             REQUIRED)

file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_code REGEX "#define NCCL_VERSION_CODE")
string(REGEX MATCH "[0-9]+" NCCL_VERSION_CODE "${_nccl_code}")
if(NCCL_VERSION_CODE LESS 22800)
  message(FATAL_ERROR "megamoe needs NCCL >= 2.28 (device API); found version code ${NCCL_VERSION_CODE} in ${NCCL_INCLUDE_DIR}")
endif()

get_filename_component(_nccl_name "${NCCL_LIBRARY_PATH}" NAME)
if(_nccl_name MATCHES "\\.so\\.[0-9]+$")
  set(_nccl_link_dir "${CMAKE_BINARY_DIR}/nccl-link")
  file(MAKE_DIRECTORY "${_nccl_link_dir}")
  file(CREATE_LINK "${NCCL_LIBRARY_PATH}" "${_nccl_link_dir}/libnccl.so" SYMBOLIC)
  file(CREATE_LINK "${NCCL_LIBRARY_PATH}" "${_nccl_link_dir}/${_nccl_name}" SYMBOLIC)
  set(NCCL_LIBRARY_PATH "${_nccl_link_dir}/libnccl.so")
endif()

add_library(megamoe_nccl INTERFACE)
target_include_directories(megamoe_nccl INTERFACE "${NCCL_INCLUDE_DIR}")
target_link_libraries(megamoe_nccl INTERFACE "${NCCL_LIBRARY_PATH}")
message(STATUS "NCCL ${NCCL_VERSION_CODE}: ${NCCL_INCLUDE_DIR}, ${NCCL_LIBRARY_PATH}")
