// The handler may run on any thread (torch's and the communicators' threads included) while the
// loop updates the note, so the note is double-buffered: the loop writes the buffer not in use
// and then publishes it with one atomic store; the step is an atomic integer the handler formats
// itself (snprintf is not async-signal-safe).
#include "polytrain/trainer/interrupt_note.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>

namespace polytrain {

namespace {

constexpr size_t kNoteBytes = 8192;
constexpr int kSignals[] = {SIGINT, SIGTERM};

char g_note[2][kNoteBytes];
std::atomic<size_t> g_note_len[2];
std::atomic<int> g_published{-1};  // the buffer the handler prints; -1: no checkpoint yet
std::atomic<int64_t> g_step{0};
std::atomic<bool> g_speaks{false};
struct sigaction g_previous[2];
bool g_installed[2] = {false, false};
std::mutex g_mutex;  // installs and removes, and the writers of the note
int g_users = 0;

const char kNone[] = "no checkpoint was saved yet (nothing to resume)\n";

void write_all(const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(STDERR_FILENO, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;
    p += w;
    n -= static_cast<size_t>(w);
  }
}

// "interrupted at step N: " into buf (async-signal-safe); returns its length.
size_t format_prefix(char* buf, int64_t step) {
  static const char kHead[] = "\ninterrupted at step ";
  size_t n = sizeof kHead - 1;
  std::memcpy(buf, kHead, n);
  char digits[24];
  size_t d = 0;
  uint64_t v = step < 0 ? 0 : static_cast<uint64_t>(step);
  do digits[d++] = static_cast<char>('0' + v % 10), v /= 10;
  while (v > 0);
  while (d > 0) buf[n++] = digits[--d];
  buf[n++] = ':';
  buf[n++] = ' ';
  return n;
}

void on_interrupt(int sig) {
  const int saved = errno;
  if (g_speaks.load()) {
    char prefix[64];
    write_all(prefix, format_prefix(prefix, g_step.load()));
    const int b = g_published.load();
    if (b < 0) write_all(kNone, sizeof kNone - 1);
    else write_all(g_note[b], g_note_len[b].load());
  }
  // The action found before ours, then the signal again: it is blocked while this handler runs,
  // so it is delivered with that action as soon as the handler returns.
  const int k = sig == SIGINT ? 0 : 1;
  ::sigaction(sig, &g_previous[k], nullptr);
  ::raise(sig);
  errno = saved;
}

void install() {
  for (int k = 0; k < 2; ++k) {
    struct sigaction current {};
    ::sigaction(kSignals[k], nullptr, &current);
    g_installed[k] = current.sa_handler != SIG_IGN;  // nohup, or a job started with SIGINT ignored
    if (!g_installed[k]) continue;
    struct sigaction sa {};
    sa.sa_handler = on_interrupt;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    ::sigaction(kSignals[k], &sa, &g_previous[k]);
  }
}

void restore() {
  for (int k = 0; k < 2; ++k)
    if (g_installed[k]) ::sigaction(kSignals[k], &g_previous[k], nullptr), g_installed[k] = false;
}

}  // namespace

InterruptNote::InterruptNote(bool speaks) : speaks_(speaks) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_users++ == 0) {
    g_published.store(-1);
    g_step.store(0);
    g_speaks.store(false);
    install();
  }
  if (speaks_) g_speaks.store(true);
}

InterruptNote::~InterruptNote() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (--g_users == 0) restore();
}

void InterruptNote::set_step(int64_t step) {
  if (speaks_) g_step.store(step);
}

void InterruptNote::set_checkpoint(const std::string& dir, const std::string& tag) {
  if (!speaks_) return;
  const std::string text = "last complete checkpoint " + dir + "/" + tag + "; resume with --load_dir " + dir + "\n";
  std::lock_guard<std::mutex> lock(g_mutex);
  const int b = g_published.load() == 0 ? 1 : 0;
  const size_t n = std::min(text.size(), kNoteBytes);
  std::memcpy(g_note[b], text.data(), n);
  g_note_len[b].store(n);
  g_published.store(b);
}

std::string interrupt_note_text() {
  char prefix[64];
  std::string s(prefix, format_prefix(prefix, g_step.load()));
  const int b = g_published.load();
  return s + (b < 0 ? std::string(kNone) : std::string(g_note[b], g_note_len[b].load()));
}

}  // namespace polytrain
