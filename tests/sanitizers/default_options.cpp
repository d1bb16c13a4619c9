// Linked into every program of a sanitizer build (POLYTRAIN_SANITIZE): the runtimes' default
// options, so that the tests, the programs they start and a user's run all get the same ones
// without environment variables (ASAN_OPTIONS etc. still override them).
#ifndef POLYTRAIN_SANITIZER_DIR
#error "POLYTRAIN_SANITIZER_DIR must name tests/sanitizers"
#endif

extern "C" {
// Leaks are findings; a stack-use-after-return check would slow libtorch's kernels 2x for
// nothing of ours.
const char* __asan_default_options() { return "detect_leaks=1:detect_stack_use_after_return=0:check_initialization_order=1"; }
const char* __lsan_default_options() { return "print_suppressions=0:suppressions=" POLYTRAIN_SANITIZER_DIR "/lsan.supp"; }
const char* __ubsan_default_options() {
  return "print_stacktrace=1:halt_on_error=1:suppressions=" POLYTRAIN_SANITIZER_DIR "/ubsan.supp";
}
const char* __tsan_default_options() {
  return "halt_on_error=1:second_deadlock_stack=1:suppressions=" POLYTRAIN_SANITIZER_DIR "/tsan.supp";
}
}
