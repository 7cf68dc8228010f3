# `cmake --install BUILD --prefix PREFIX` installs the static library, the public headers, the
# command-line tool, and a CMake package: a consumer's find_package(megamoe CONFIG) gives
# megamoe::megamoe, which brings the CUDA runtime, NCCL and the headers with it. Component
# "development" holds all of it, so that the Python wheel (component "python") leaves it out.
include(CMakePackageConfigHelpers)

set(MEGAMOE_CMAKE_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/megamoe")
install(TARGETS megamoe EXPORT megamoeTargets ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}" COMPONENT development)
install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/megamoe" DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}"
        COMPONENT development)
if(TARGET megamoe_cli)
  install(TARGETS megamoe_cli RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}" COMPONENT development OPTIONAL)
endif()
install(EXPORT megamoeTargets NAMESPACE megamoe:: DESTINATION "${MEGAMOE_CMAKE_DIR}" COMPONENT development)

# Where this build found NCCL: the installed package looks there first (NCCL_ROOT overrides it).
get_filename_component(MEGAMOE_NCCL_ROOT "${NCCL_INCLUDE_DIR}" DIRECTORY)
configure_package_config_file("${PROJECT_SOURCE_DIR}/cmake/megamoeConfig.cmake.in"
                              "${PROJECT_BINARY_DIR}/megamoeConfig.cmake" INSTALL_DESTINATION "${MEGAMOE_CMAKE_DIR}")
write_basic_package_version_file("${PROJECT_BINARY_DIR}/megamoeConfigVersion.cmake" COMPATIBILITY SameMinorVersion)
install(FILES "${PROJECT_BINARY_DIR}/megamoeConfig.cmake" "${PROJECT_BINARY_DIR}/megamoeConfigVersion.cmake"
        DESTINATION "${MEGAMOE_CMAKE_DIR}" COMPONENT development)
install(FILES "${PROJECT_SOURCE_DIR}/cmake/FindNccl.cmake" DESTINATION "${MEGAMOE_CMAKE_DIR}"
        RENAME megamoeFindNccl.cmake COMPONENT development)
