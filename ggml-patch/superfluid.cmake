# superfluid's change to the llama.cpp that llama-cpp-sys-2 builds.
#
# CMake includes this file after each project() of that build: .cargo/config.toml
# sets CMAKE_PROJECT_INCLUDE to it, and llama-cpp-sys-2's build script passes
# every CMAKE_* variable of its environment to CMake. Once every target is
# defined, it writes a copy of ggml/src/ggml-cpu/ops.cpp into the build
# directory with ggml_compute_forward_flash_attn_ext_tiled replaced by
# fa-tiled.cpp (the tiled CPU flash attention, trimmed to the rows and cells a
# mask leaves; see that file) and compiles the copy in place of the original.
# The crate's sources are not touched.
#
# Cargo reruns llama-cpp-sys-2's build script when a GGML_* variable changes,
# not when this file or fa-tiled.cpp does: after editing either, change
# GGML_SUPERFLUID_PATCH in .cargo/config.toml (and SUPERFLUID_GGML_PATCH
# here, which only names the version in the build log), or a cached build
# keeps the old kernel. The build script then runs CMake's build, which
# configures again because these files changed (a configured build is never
# configured again otherwise: llama-cpp-sys-2 sets always_configure(false),
# and a reconfigure keeps the cached -D values). A llama.cpp whose ops.cpp no
# longer has the function stops the build here, by name.

set(SUPERFLUID_GGML_PATCH "fa-trim-3")

if(SUPERFLUID_GGML_PATCH_QUEUED)
    return()
endif()
set(SUPERFLUID_GGML_PATCH_QUEUED ON)

if(CMAKE_VERSION VERSION_LESS 3.19)
    message(FATAL_ERROR
        "superfluid: CMake ${CMAKE_VERSION} is too old for ggml-patch/superfluid.cmake "
        "(cmake_language(DEFER) needs 3.19 or newer)")
endif()

set(SUPERFLUID_GGML_PATCH_DIR "${CMAKE_CURRENT_LIST_DIR}")
# An edit to the replacement reconfigures a build that runs again (this file
# is watched as any included one).
set_property(DIRECTORY "${CMAKE_SOURCE_DIR}" APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS
    "${SUPERFLUID_GGML_PATCH_DIR}/fa-tiled.cpp")

function(superfluid_patch_ggml_cpu)
    set(ops "${CMAKE_SOURCE_DIR}/ggml/src/ggml-cpu/ops.cpp")
    file(READ "${ops}" text)
    file(READ "${SUPERFLUID_GGML_PATCH_DIR}/fa-tiled.cpp" replacement)
    set(begin_marker "static void ggml_compute_forward_flash_attn_ext_tiled(")
    set(end_marker "// Reduction function: combines partial results across KV chunks")
    string(FIND "${text}" "${begin_marker}" begin)
    string(FIND "${text}" "${end_marker}" end)
    if(begin EQUAL -1 OR end EQUAL -1 OR NOT end GREATER begin)
        message(FATAL_ERROR
            "superfluid: ${ops} has no ggml_compute_forward_flash_attn_ext_tiled "
            "followed by the reduction function; ggml-patch/fa-tiled.cpp was written "
            "for llama-cpp-sys-2 0.1.161 (llama.cpp b11434)")
    endif()
    string(SUBSTRING "${text}" 0 ${begin} before)
    string(SUBSTRING "${text}" ${end} -1 after)
    set(patched "${CMAKE_BINARY_DIR}/superfluid/ggml-cpu/ops.cpp")
    set(content "${before}${replacement}\n${after}")
    # Written only when it changes, so a reconfigure compiles nothing again.
    set(old "")
    if(EXISTS "${patched}")
        file(READ "${patched}" old)
    endif()
    if(NOT old STREQUAL content)
        file(WRITE "${patched}" "${content}")
    endif()

    get_property(targets DIRECTORY "${CMAKE_SOURCE_DIR}/ggml/src" PROPERTY BUILDSYSTEM_TARGETS)
    set(replaced 0)
    foreach(target IN LISTS targets)
        get_target_property(sources ${target} SOURCES)
        if(NOT sources)
            continue()
        endif()
        list(FIND sources "ggml-cpu/ops.cpp" at)
        if(at EQUAL -1)
            continue()
        endif()
        list(REMOVE_AT sources ${at})
        list(INSERT sources ${at} "${patched}")
        set_property(TARGET ${target} PROPERTY SOURCES "${sources}")
        math(EXPR replaced "${replaced} + 1")
        message(STATUS "superfluid: ${target} compiles ${patched} (${SUPERFLUID_GGML_PATCH})")
    endforeach()
    if(replaced EQUAL 0)
        message(FATAL_ERROR "superfluid: no target of ggml/src compiles ggml-cpu/ops.cpp")
    endif()
endfunction()

cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL superfluid_patch_ggml_cpu)
