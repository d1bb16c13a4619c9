// TensorBoardWriter: appends scalar summaries to a TensorBoard event file (TFRecord framing
// of hand-encoded tensorflow.Event protobufs; no protobuf library). Deciding what to log,
// how often, and reducing values across ranks is left to the Trainer and its metric sinks.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace polytrain {

/// Writes `<log_dir>/events.out.tfevents.<unix_time>.<hostname>` (a `.<pid>.<n>` suffix is
/// added if that name is taken), readable by TensorBoard while it is being written. The
/// first record is the `brain.Event:2` file-version event. Not thread-safe; one writer per
/// file (call it from rank 0 only).
class TensorBoardWriter {
 public:
  /// Creates log_dir (and parents) if needed. InputError if it cannot be created or the
  /// event file cannot be opened there.
  explicit TensorBoardWriter(const std::string& log_dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  /// One Event{wall_time=now, step, summary{value{tag, simple_value=float(value)}}}.
  /// InternalError if the write fails.
  void add_scalar(const std::string& tag, double value, int64_t step);

  /// Pushes buffered records to the OS (no fsync), so TensorBoard sees them.
  void flush();

  /// The event file's path.
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& data);

  std::string path_;
  std::FILE* file_ = nullptr;
};

namespace tensorboard_detail {
/// The serialized tensorflow.Event protobufs the writer emits, exposed for tests.
std::string encode_file_version_event(double wall_time);
std::string encode_scalar_event(double wall_time, int64_t step, const std::string& tag,
                                float value);
/// TFRecord framing: le64 length, masked crc32c(length), data, masked crc32c(data).
std::string frame_record(const std::string& data);
}  // namespace tensorboard_detail

}  // namespace polytrain
