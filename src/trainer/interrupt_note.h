// What an interrupted run says on its way out (Ctrl-C, or the SIGTERM the launcher forwards to
// every rank): "interrupted at step N: last complete checkpoint D/global_stepK; resume with
// --load_dir D", or that none was saved. The handler only write(2)s a message prepared after
// each save and re-raises the signal with the action it found, so the exit status (130, 143)
// and any handler installed before it are kept; a signal that was ignored stays ignored.
#pragma once

#include <cstdint>
#include <string>

namespace polytrain {

/// Installs the SIGINT / SIGTERM handlers while it lives (nested or concurrent notes, e.g. ranks
/// as threads of one test, share them: the first installs, the last restores). `speaks`: this
/// process prints the note (the rank that writes logs); the others only pass the signal on.
class InterruptNote {
 public:
  explicit InterruptNote(bool speaks);
  ~InterruptNote();
  InterruptNote(const InterruptNote&) = delete;
  InterruptNote& operator=(const InterruptNote&) = delete;

  /// Optimizer steps completed so far.
  void set_step(int64_t step);
  /// The newest complete checkpoint: `dir`/`tag`, resumed with --load_dir `dir`.
  void set_checkpoint(const std::string& dir, const std::string& tag);

 private:
  bool speaks_;
};

/// The note as the handler would print it now (tests).
std::string interrupt_note_text();

}  // namespace polytrain
