# flatparam_kit_cxx_standard(OUT TORCH_STANDARD OVERRIDE): the C++ standard
# the kit compiles with, in OUT. LibTorch says which one its headers need
# by the CXX_STANDARD property of its `torch` target (TORCH_STANDARD: 14 in
# 1.13, 17 in 2.x, 20 from the releases whose headers stop at an #error
# below C++20, e.g. 2.14). CXX_STANDARD does not pass from an imported
# target to its users, so the kit takes it over: that standard, and at
# least 17 (flatparam's own). OVERRIDE, when not empty, is taken as it is
# (FLATPARAM_KIT_CXX_STANDARD: CI builds the kit as C++20 against
# LibTorch 1.13 to check flatparam's sources compile as C++20).
function(flatparam_kit_cxx_standard out torch_standard override)
  if(NOT "${override}" STREQUAL "")
    if(NOT override MATCHES "^(17|20|23)$")
      message(FATAL_ERROR "FLATPARAM_KIT_CXX_STANDARD='${override}': want 17, 20 or 23")
    endif()
    set(${out} "${override}" PARENT_SCOPE)
    return()
  endif()
  set(standard 17)
  if(torch_standard MATCHES "^[0-9]+$" AND torch_standard GREATER standard)
    set(standard "${torch_standard}")
  endif()
  set(${out} "${standard}" PARENT_SCOPE)
endfunction()
