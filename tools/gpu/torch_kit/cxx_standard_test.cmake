# Checks flatparam_kit_cxx_standard (cxx_standard.cmake):
#   cmake -P cxx_standard_test.cmake
# Prints "cxx_standard_test: ok" or fails with the case that did not hold.
include("${CMAKE_CURRENT_LIST_DIR}/cxx_standard.cmake")

function(expect torch_standard override want)
  flatparam_kit_cxx_standard(got "${torch_standard}" "${override}")
  if(NOT got STREQUAL want)
    message(FATAL_ERROR "torch CXX_STANDARD '${torch_standard}', override "
                        "'${override}': got C++${got}, want C++${want}")
  endif()
endfunction()

expect("14" "" 17)  # LibTorch 1.13
expect("17" "" 17)  # 2.x before C++20
expect("20" "" 20)  # 2.14
expect("torch_standard-NOTFOUND" "" 17)  # a TorchConfig that sets none
expect("" "" 17)
expect("14" "20" 20)  # CI's C++20 build against 1.13
expect("20" "17" 17)
message(STATUS "cxx_standard_test: ok")
