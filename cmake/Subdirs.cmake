# Adds every immediate subdirectory of the current source dir that has a CMakeLists.txt, so each
# component owns its own list of sources and tests.
function(megamoe_add_subdirectories)
  file(GLOB _entries LIST_DIRECTORIES true "${CMAKE_CURRENT_SOURCE_DIR}/*")
  list(SORT _entries)
  foreach(_entry ${_entries})
    if(IS_DIRECTORY "${_entry}" AND EXISTS "${_entry}/CMakeLists.txt")
      add_subdirectory("${_entry}")
    endif()
  endforeach()
endfunction()
