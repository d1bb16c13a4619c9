# POLYTRAIN_SANITIZE=thread: ThreadSanitizer over the code that runs its own threads without
# libtorch underneath (TSan needs every library that synchronises with that code instrumented;
# libtorch, Gloo and Open MPI from Debian are not, so a TSan build of the trainer would report
# their internal hand-offs, not polytrain's). What it builds, all with -fsanitize=thread:
#   polytrain_core_tsan  the hivemind core (DHT records, progress, matchmaking, butterfly
#                        all-reduce over asio, state download, metrics) and the launcher
#   test_hivemind_dht, test_hivemind_averaging, test_launcher   (ctest; options and suppressions
#   from tests/sanitizers/default_options.cpp)
# Included from CMakeLists.txt, which returns after it.
if(NOT POLYTRAIN_WITH_HIVEMIND)
  message(FATAL_ERROR "POLYTRAIN_SANITIZE=thread checks the hivemind core: it needs libopendht-dev libsodium-dev "
                      "libasio-dev libmsgpack-cxx-dev")
endif()
file(GLOB _tsan_sources ${PROJECT_SOURCE_DIR}/src/swarm/*.cpp ${PROJECT_SOURCE_DIR}/src/launcher/*.cpp)
list(FILTER _tsan_sources EXCLUDE REGEX ".*_main\\.cpp$")
list(APPEND _tsan_sources ${PROJECT_SOURCE_DIR}/src/common/crc32c.cpp ${PROJECT_SOURCE_DIR}/src/common/atomic_file.cpp
     ${PROJECT_SOURCE_DIR}/src/common/fault.cpp)
add_library(polytrain_core_tsan STATIC ${_tsan_sources})
target_include_directories(polytrain_core_tsan PUBLIC ${POLYTRAIN_INCLUDE_DIR} ${NLOHMANN_JSON_INCLUDE} ${CLI11_INCLUDE}
                           ${ASIO_INCLUDE} ${MSGPACK_INCLUDE} ${PC_OPENDHT_INCLUDE_DIRS})
target_compile_definitions(polytrain_core_tsan PUBLIC ASIO_STANDALONE POLYTRAIN_WITH_HIVEMIND=1)
target_link_libraries(polytrain_core_tsan PUBLIC ${OPENDHT_LIBRARY} ${PC_OPENDHT_LIBRARIES} ${SODIUM_LIBRARY} Threads::Threads)

enable_testing()
find_package(GTest REQUIRED)
include(GoogleTest)
foreach(name test_hivemind_dht test_hivemind_averaging test_launcher)
  add_executable(${name} ${PROJECT_SOURCE_DIR}/tests/${name}.cpp)
  target_link_libraries(${name} PRIVATE polytrain_core_tsan GTest::gtest GTest::gtest_main)
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests)
  target_compile_definitions(${name} PRIVATE POLYTRAIN_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
                                             POLYTRAIN_BINARY_DIR="${PROJECT_BINARY_DIR}")
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60
    PROPERTIES ENVIRONMENT "POLYTRAIN_SOURCE_DIR=${PROJECT_SOURCE_DIR}")
endforeach()
polytrain_sanitizer_defaults()
