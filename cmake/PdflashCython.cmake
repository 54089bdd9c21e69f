# pdflash_cython_module(<name> [DEPENDS files...] [LINK targets...])
#
# Cythonizes pdflash_native/<name>.pyx to C++ and builds it as the extension
# module pdflash_native.<name>. A small function of our own instead of
# cython-cmake, so that a build needs nothing beyond Cython itself (the GPU
# machine has no network to fetch build helpers).
function(pdflash_cython_module name)
  cmake_parse_arguments(ARG "" "" "DEPENDS;LINK" ${ARGN})
  set(pyx "${PROJECT_SOURCE_DIR}/pdflash_native/${name}.pyx")
  set(cpp "${CMAKE_CURRENT_BINARY_DIR}/${name}.cpp")
  file(GLOB pxds "${PROJECT_SOURCE_DIR}/pdflash_native/*.pxd")
  add_custom_command(
    OUTPUT "${cpp}"
    COMMAND Python::Interpreter -m cython --cplus -3
            -I "${PROJECT_SOURCE_DIR}"
            -X boundscheck=False -X wraparound=False -X cdivision=True
            -X initializedcheck=False -X embedsignature=True
            "${pyx}" -o "${cpp}"
    DEPENDS "${pyx}" ${pxds} ${ARG_DEPENDS}
    COMMENT "Cythonizing pdflash_native/${name}.pyx"
    VERBATIM)
  python_add_library(${name} MODULE WITH_SOABI "${cpp}")
  target_include_directories(${name} PRIVATE "${PROJECT_SOURCE_DIR}/cuda/include")
  if(ARG_LINK)
    target_link_libraries(${name} PRIVATE ${ARG_LINK})
  endif()
  if(NOT MSVC)
    target_compile_options(${name} PRIVATE -O3)
  endif()
  install(TARGETS ${name} LIBRARY DESTINATION pdflash_native)
endfunction()
