// Event-file encoding by hand: the few protobuf wire-format rules needed (varint keys,
// fixed64 double, fixed32 float, length-delimited strings and sub-messages) for the fields of
// tensorflow/core/util/event.proto and summary.proto that a scalar needs, and TFRecord
// framing with masked CRC-32C. Field numbers are the .proto ones; changing them breaks readers.
#include "polytrain/trainer/tensorboard.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>

#include "polytrain/common/crc32c.h"
#include "polytrain/common/error.h"

namespace polytrain {
namespace tensorboard_detail {
namespace {

// Protobuf wire types.
constexpr uint32_t kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;

// tensorflow.Event fields.
constexpr uint32_t kEventWallTime = 1, kEventStep = 2, kEventFileVersion = 3, kEventSummary = 5;
// tensorflow.Summary and Summary.Value fields.
constexpr uint32_t kSummaryValue = 1, kValueTag = 1, kValueSimpleValue = 2;

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_key(std::string& out, uint32_t field, uint32_t wire_type) {
  put_varint(out, (static_cast<uint64_t>(field) << 3) | wire_type);
}

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

void put_double(std::string& out, uint32_t field, double d) {
  uint64_t bits;
  std::memcpy(&bits, &d, 8);
  put_key(out, field, kFixed64);
  put_le(out, bits, 8);
}

void put_float(std::string& out, uint32_t field, float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  put_key(out, field, kFixed32);
  put_le(out, bits, 4);
}

void put_bytes(std::string& out, uint32_t field, const std::string& bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out += bytes;
}

// Event's header fields. proto3 leaves a zero step out, as protobuf's own serializer does;
// readers default it to 0.
std::string event_prefix(double wall_time, int64_t step) {
  std::string out;
  put_double(out, kEventWallTime, wall_time);
  if (step != 0) {
    put_key(out, kEventStep, kVarint);
    put_varint(out, static_cast<uint64_t>(step));  // int64: two's complement, 10 bytes if < 0
  }
  return out;
}

}  // namespace

std::string encode_file_version_event(double wall_time) {
  std::string out = event_prefix(wall_time, 0);
  put_bytes(out, kEventFileVersion, "brain.Event:2");
  return out;
}

std::string encode_scalar_event(double wall_time, int64_t step, const std::string& tag,
                                float value) {
  std::string summary_value;
  put_bytes(summary_value, kValueTag, tag);
  // simple_value is in a oneof, so it is written even when 0.
  put_float(summary_value, kValueSimpleValue, value);
  std::string summary;
  put_bytes(summary, kSummaryValue, summary_value);
  std::string out = event_prefix(wall_time, step);
  put_bytes(out, kEventSummary, summary);
  return out;
}

std::string frame_record(const std::string& data) {
  std::string out;
  out.reserve(data.size() + 16);
  put_le(out, data.size(), 8);
  const uint32_t len_crc = masked_crc32c(out.data(), 8);
  put_le(out, len_crc, 4);
  out += data;
  put_le(out, masked_crc32c(data.data(), data.size()), 4);
  return out;
}

}  // namespace tensorboard_detail

namespace {

double now_seconds() {
  using namespace std::chrono;
  return duration_cast<microseconds>(system_clock::now().time_since_epoch()).count() / 1e6;
}

std::string host_name() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "localhost";
  return buf;
}

}  // namespace

TensorBoardWriter::TensorBoardWriter(const std::string& log_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(log_dir, ec);
  PT_INPUT_CHECK(!ec, "cannot create TensorBoard log_dir ", log_dir, ": ", ec.message());
  PT_INPUT_CHECK(fs::is_directory(log_dir), "TensorBoard log_dir ", log_dir,
                 " is not a directory");

  const double wall_time = now_seconds();
  const std::string base = log_dir + "/events.out.tfevents." +
                           std::to_string(static_cast<int64_t>(std::time(nullptr))) + "." +
                           host_name();
  // "x" opens exclusively, so two writers started in the same second never share a file.
  path_ = base;
  for (int n = 0; (file_ = std::fopen(path_.c_str(), "wbx")) == nullptr; ++n) {
    const int err = errno;
    PT_INPUT_CHECK(err == EEXIST && n < 1000, "cannot open TensorBoard event file ", path_,
                   ": ", std::strerror(err));
    path_ = base + "." + std::to_string(::getpid()) + "." + std::to_string(n);
  }
  write_record(tensorboard_detail::encode_file_version_event(wall_time));
  flush();
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_ != nullptr) std::fclose(file_);  // flushes; errors cannot be reported here
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  write_record(tensorboard_detail::encode_scalar_event(now_seconds(), step, tag,
                                                       static_cast<float>(value)));
}

void TensorBoardWriter::flush() {
  if (std::fflush(file_) != 0)
    throw InternalError(detail::cat("cannot flush ", path_, ": ", std::strerror(errno)));
}

void TensorBoardWriter::write_record(const std::string& data) {
  const std::string record = tensorboard_detail::frame_record(data);
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size())
    throw InternalError(detail::cat("cannot write ", path_, ": ", std::strerror(errno)));
}

}  // namespace polytrain
