// TensorBoardWriter: a decoder written here (TFRecord framing, every CRC, protobuf wire
// format) recovers the file-version event and every scalar; exact bytes for one event; and,
// when /usr/bin/python3 is present, scripts/read_tfevents.py decodes the same file
// independently (with the protobuf library when python3-protobuf is installed).
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "helpers/process.h"
#include "polytrain/common/atomic_file.h"
#include "polytrain/common/crc32c.h"
#include "polytrain/common/error.h"
#include "polytrain/trainer/tensorboard.h"
#include "helpers/require.h"
#include "helpers/temp_dir.h"

namespace polytrain {
namespace {

namespace fs = std::filesystem;

struct Event {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  std::vector<std::pair<std::string, float>> values;
};

uint64_t le(const std::string& s, size_t pos, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(s.at(pos + i));
  return v;
}

uint64_t varint(const std::string& s, size_t& pos) {
  uint64_t v = 0;
  for (int shift = 0;; shift += 7) {
    const uint8_t b = static_cast<uint8_t>(s.at(pos++));
    v |= static_cast<uint64_t>(b & 0x7F) << shift;
    if (!(b & 0x80)) return v;
  }
}

// Calls fn(field, wire_type, varint_or_fixed, bytes) for each field of a message.
template <typename Fn>
void for_each_field(const std::string& msg, Fn fn) {
  size_t pos = 0;
  while (pos < msg.size()) {
    const uint64_t key = varint(msg, pos);
    const uint32_t field = static_cast<uint32_t>(key >> 3), wire = key & 7;
    uint64_t number = 0;
    std::string bytes;
    if (wire == 0) {
      number = varint(msg, pos);
    } else if (wire == 1 || wire == 5) {
      const int n = wire == 1 ? 8 : 4;
      number = le(msg, pos, n);
      pos += n;
    } else if (wire == 2) {
      const uint64_t n = varint(msg, pos);
      bytes = msg.substr(pos, n);
      ASSERT_EQ(bytes.size(), n) << "field " << field << " runs past its message";
      pos += n;
    } else {
      FAIL() << "unexpected wire type " << wire;
    }
    fn(field, wire, number, bytes);
  }
  ASSERT_EQ(pos, msg.size());
}

Event decode_event(const std::string& data) {
  Event ev;
  for_each_field(data, [&](uint32_t f, uint32_t w, uint64_t num, const std::string& bytes) {
    if (f == 1 && w == 1) std::memcpy(&ev.wall_time, &num, 8);
    else if (f == 2 && w == 0) ev.step = static_cast<int64_t>(num);
    else if (f == 3 && w == 2) ev.file_version = bytes;
    else if (f == 5 && w == 2) {
      for_each_field(bytes, [&](uint32_t sf, uint32_t sw, uint64_t, const std::string& value) {
        ASSERT_TRUE(sf == 1 && sw == 2) << "Summary field " << sf;
        std::string tag;
        float simple = NAN;
        for_each_field(value, [&](uint32_t vf, uint32_t vw, uint64_t vnum, const std::string& b) {
          if (vf == 1 && vw == 2) tag = b;
          if (vf == 2 && vw == 5) {
            const uint32_t bits = static_cast<uint32_t>(vnum);
            std::memcpy(&simple, &bits, 4);
          }
        });
        ev.values.emplace_back(tag, simple);
      });
    } else {
      ADD_FAILURE() << "unexpected Event field " << f << " wire " << w;
    }
  });
  return ev;
}

// Splits TFRecords, checking both masked CRCs of each.
std::vector<Event> read_events(const std::string& path) {
  const std::string blob = read_file(path);
  std::vector<Event> events;
  size_t pos = 0;
  while (pos < blob.size()) {
    EXPECT_GE(blob.size() - pos, 16u) << "truncated record at " << pos;
    if (blob.size() - pos < 16) break;
    const uint64_t len = le(blob, pos, 8);
    EXPECT_EQ(le(blob, pos + 8, 4), masked_crc32c(blob.data() + pos, 8)) << "length crc @" << pos;
    const std::string data = blob.substr(pos + 12, len);
    EXPECT_EQ(data.size(), len);
    EXPECT_EQ(le(blob, pos + 12 + len, 4), masked_crc32c(data.data(), data.size()))
        << "data crc @" << pos;
    events.push_back(decode_event(data));
    pos += 16 + len;
  }
  return events;
}

class TensorBoardTest : public ::testing::Test {
 protected:
  // Writes a fixed set of scalars; returns the event file path.
  std::string write_sample(const std::string& log_dir) {
    TensorBoardWriter w(log_dir);
    w.add_scalar("loss", 2.5, 0);
    w.add_scalar("loss", 1.25, 1);
    w.add_scalar("train/lr", 1e-4, 1000);
    w.add_scalar("zero", 0.0, 1LL << 40);
    w.add_scalar("neg_step", -3.0, -7);
    w.add_scalar("ünïcode tag", 3.0, 2);
    w.flush();
    return w.path();
  }

  testing::TempDir tmp_{"pt_tb"};
  const std::string dir_ = tmp_.str();
};

const std::vector<std::tuple<std::string, float, int64_t>> kExpected = {
    {"loss", 2.5f, 0},       {"loss", 1.25f, 1},  {"train/lr", 1e-4f, 1000},
    {"zero", 0.0f, 1LL << 40}, {"neg_step", -3.0f, -7}, {"ünïcode tag", 3.0f, 2}};

TEST_F(TensorBoardTest, FileIsDecodableWithAllCrcs) {
  const double before = std::chrono::duration<double>(
      std::chrono::system_clock::now().time_since_epoch()).count();
  const std::string log_dir = dir_ + "/runs/exp1";  // created, parents included
  const std::string path = write_sample(log_dir);
  EXPECT_EQ(fs::path(path).parent_path(), fs::path(log_dir));
  EXPECT_EQ(fs::path(path).filename().string().rfind("events.out.tfevents.", 0), 0u) << path;

  const auto events = read_events(path);
  ASSERT_EQ(events.size(), 1 + kExpected.size());
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_TRUE(events[0].values.empty());
  for (size_t i = 0; i < kExpected.size(); ++i) {
    const Event& ev = events[i + 1];
    ASSERT_EQ(ev.values.size(), 1u);
    EXPECT_EQ(ev.values[0].first, std::get<0>(kExpected[i]));
    EXPECT_EQ(ev.values[0].second, std::get<1>(kExpected[i]));
    EXPECT_EQ(ev.step, std::get<2>(kExpected[i]));
  }
  for (const Event& ev : events) {
    EXPECT_GE(ev.wall_time, before - 1);
    EXPECT_LE(ev.wall_time, before + 60);
  }
}

TEST_F(TensorBoardTest, ExactBytesOfOneEvent) {
  // Event{wall_time=1.5, step=3, summary{value{tag="a", simple_value=2}}}, encoded by hand
  // from event.proto / summary.proto field numbers.
  const std::string expected(
      "\x09\x00\x00\x00\x00\x00\x00\xF8\x3F"  // 1: fixed64 1.5
      "\x10\x03"                              // 2: varint 3
      "\x2A\x0A"                              // 5: summary, 10 bytes
      "\x0A\x08"                              //   1: value, 8 bytes
      "\x0A\x01" "a"                          //     1: tag
      "\x15\x00\x00\x00\x40",                 //     2: fixed32 2.0f
      23);
  EXPECT_EQ(tensorboard_detail::encode_scalar_event(1.5, 3, "a", 2.0f), expected);
  const std::string framed = tensorboard_detail::frame_record(expected);
  ASSERT_EQ(framed.size(), expected.size() + 16);
  EXPECT_EQ(le(framed, 0, 8), expected.size());
  EXPECT_EQ(framed.substr(12, expected.size()), expected);
}

TEST_F(TensorBoardTest, CorruptionIsDetectedByTheTestReader) {
  const std::string path = write_sample(dir_);
  std::string blob = read_file(path);
  blob[blob.size() - 6] ^= 0x01;  // inside the last record's data
  const std::string bad = dir_ + "/corrupt.tfevents";
  atomic_write_file(bad, blob);
  ::testing::TestPartResultArray failures;
  {
    ::testing::ScopedFakeTestPartResultReporter reporter(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &failures);
    read_events(bad);
  }
  EXPECT_GE(failures.size(), 1);
}

TEST_F(TensorBoardTest, TwoWritersGetTwoFiles) {
  TensorBoardWriter a(dir_), b(dir_);
  EXPECT_NE(a.path(), b.path());
  a.add_scalar("x", 1, 1);
  b.add_scalar("x", 2, 1);
}

TEST_F(TensorBoardTest, LogDirThatIsAFileIsInputError) {
  const std::string file = dir_ + "/plain";
  atomic_write_file(file, std::string("x"));
  EXPECT_THROW(TensorBoardWriter w(file), InputError);
}

// Runs cmd, returns its exit status and stdout.
int run(const std::string& cmd, std::string* out) { return polytrain::testing::run_command(cmd, out); }

void check_with_python(const std::string& dir, const std::string& decoder,
                       const std::string& path) {
  const std::string script = std::string(POLYTRAIN_SOURCE_DIR) + "/scripts/read_tfevents.py";
  std::string out;
  const int rc = run("/usr/bin/python3 " + script + " --decoder=" + decoder + " '" + path + "'",
                     &out);
  PT_SKIP_UNLESS(rc != 3, "the protobuf library for /usr/bin/python3 (Debian python3-protobuf)");
  ASSERT_EQ(rc, 0) << out;
  std::vector<nlohmann::json> lines;
  size_t start = 0;
  for (size_t nl; (nl = out.find('\n', start)) != std::string::npos; start = nl + 1)
    lines.push_back(nlohmann::json::parse(out.substr(start, nl - start)));
  ASSERT_EQ(lines.size(), 1 + kExpected.size()) << out;
  EXPECT_EQ(lines[0]["file_version"], "brain.Event:2");
  for (size_t i = 0; i < kExpected.size(); ++i) {
    const auto& j = lines[i + 1];
    EXPECT_EQ(j["decoder"], decoder);
    EXPECT_EQ(j["tag"].get<std::string>(), std::get<0>(kExpected[i]));
    EXPECT_EQ(static_cast<float>(j["value"].get<double>()), std::get<1>(kExpected[i]));
    EXPECT_EQ(j["step"].get<int64_t>(), std::get<2>(kExpected[i]));
  }
}

TEST_F(TensorBoardTest, IndependentPythonReaderMinimalDecoder) {
  PT_SKIP_UNLESS(::access("/usr/bin/python3", X_OK) == 0, "/usr/bin/python3 (Debian python3)");
  check_with_python(dir_, "minimal", write_sample(dir_));
}

TEST_F(TensorBoardTest, IndependentPythonReaderProtobufLibrary) {
  PT_SKIP_UNLESS(::access("/usr/bin/python3", X_OK) == 0, "/usr/bin/python3 (Debian python3)");
  check_with_python(dir_, "protobuf", write_sample(dir_));
}

}  // namespace
}  // namespace polytrain
