// safetensors: round trips over every supported dtype (0-d, empty, non-contiguous), exact
// bytes against the reference implementation's own test vectors, InputError on corrupt
// files, and an independent reader/writer in /usr/bin/python3 (json + struct + torch).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "helpers/process.h"
#include "polytrain/common/atomic_file.h"
#include "polytrain/common/error.h"
#include "polytrain/checkpoint/safetensors.h"
#include "helpers/require.h"
#include "helpers/temp_dir.h"

namespace polytrain {
namespace {

namespace fs = std::filesystem;

class SafetensorsTest : public ::testing::Test {
 protected:
  // Builds a file from a header text (padded to 8) and data bytes.
  std::string write_raw(const std::string& name, const std::string& header,
                        const std::string& data, int64_t size_override = -1) {
    std::string text = header;
    text.append((8 - text.size() % 8) % 8, ' ');
    uint64_t n = size_override >= 0 ? static_cast<uint64_t>(size_override) : text.size();
    std::string blob(reinterpret_cast<const char*>(&n), 8);
    const std::string path = dir_ + "/" + name;
    atomic_write_file(path, blob + text + data);
    return path;
  }

  // Expects load_safetensors(path) to throw InputError naming the file and `problem`.
  void expect_bad(const std::string& path, const std::string& problem) {
    try {
      load_safetensors(path);
      ADD_FAILURE() << "no error for " << path << " (" << problem << ")";
    } catch (const InputError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(path), std::string::npos) << msg;
      EXPECT_NE(msg.find(problem), std::string::npos) << msg;
    }
  }

  testing::TempDir tmp_{"pt_st"};
  const std::string dir_ = tmp_.str();
};

NamedTensors sample_tensors() {
  torch::manual_seed(0);
  return {
      {"f32", torch::randn({2, 3})},
      {"f64_scalar", torch::tensor(3.25, torch::kDouble)},
      {"f16", torch::randn({5}).to(torch::kHalf)},
      {"bf16", torch::randn({3, 1, 2}).to(torch::kBFloat16)},
      {"i64_empty", torch::zeros({0, 4}, torch::kLong)},
      {"i64", torch::arange(-5, 7, torch::kLong).reshape({3, 4})},
      {"i32", torch::tensor({1, -2, 2147483647}, torch::kInt)},
      {"i16", torch::tensor({-32768, 7}, torch::kShort)},
      {"i8", torch::tensor({-128, 127}, torch::kChar)},
      {"u8", torch::tensor({0, 255, 17}, torch::kByte)},
      {"bool", torch::tensor({true, false, true})},
      {"transposed", torch::arange(12, torch::kFloat).reshape({3, 4}).t()},
  };
}

void expect_same(const NamedTensors& expected, const NamedTensors& got) {
  std::map<std::string, torch::Tensor> by_name(got.begin(), got.end());
  ASSERT_EQ(by_name.size(), expected.size());
  for (const auto& [name, t] : expected) {
    ASSERT_TRUE(by_name.count(name)) << name;
    const auto& g = by_name[name];
    EXPECT_EQ(g.scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(g.sizes(), t.sizes()) << name;
    EXPECT_TRUE(g.is_contiguous()) << name;
    EXPECT_TRUE(torch::equal(g, t)) << name;
  }
}

TEST_F(SafetensorsTest, RoundTripEveryDtypeAndMetadata) {
  const auto tensors = sample_tensors();
  const std::string path = dir_ + "/m.safetensors";
  save_safetensors(path, tensors, {{"format", "pt"}, {"note", "ünï \"quoted\""}});
  std::map<std::string, std::string> meta;
  const auto loaded = load_safetensors(path, &meta);
  expect_same(tensors, loaded);
  EXPECT_EQ(meta, (std::map<std::string, std::string>{{"format", "pt"},
                                                       {"note", "ünï \"quoted\""}}));
  for (size_t i = 1; i < loaded.size(); ++i) EXPECT_LT(loaded[i - 1].first, loaded[i].first);
}

TEST_F(SafetensorsTest, NoTensors) {
  const std::string path = dir_ + "/empty.safetensors";
  save_safetensors(path, {});
  EXPECT_EQ(read_file(path), std::string("\x08\0\0\0\0\0\0\0{}      ", 16));
  EXPECT_TRUE(load_safetensors(path).empty());
}

// Byte vectors from the reference implementation's tests (safetensors/src/tensor.rs:
// test_serialization_forced_alignement and test_empty).
TEST_F(SafetensorsTest, ExactBytesOfReferenceVectors) {
  const std::string path = dir_ + "/ref.safetensors";
  save_safetensors(path, {{"attn0", torch::arange(6, torch::kFloat).reshape({1, 1, 2, 3})}});
  std::string expected("\x48\0\0\0\0\0\0\0", 8);
  expected += R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})";
  expected += "       ";
  const float values[] = {0, 1, 2, 3, 4, 5};
  expected.append(reinterpret_cast<const char*>(values), sizeof values);
  EXPECT_EQ(read_file(path), expected);

  save_safetensors(path, {}, {{"framework", "pt"}});
  std::string with_meta("\x28\0\0\0\0\0\0\0", 8);
  with_meta += R"({"__metadata__":{"framework":"pt"}})";
  with_meta += "     ";
  EXPECT_EQ(read_file(path), with_meta);
}

TEST_F(SafetensorsTest, OrderIsAlignmentThenName) {
  const std::string path = dir_ + "/order.safetensors";
  save_safetensors(path, {{"b", torch::ones({1}, torch::kByte)},
                          {"a", torch::ones({1}, torch::kByte)},
                          {"z", torch::ones({1}, torch::kLong)},
                          {"m", torch::ones({1}, torch::kFloat)},
                          {"h", torch::ones({1}, torch::kHalf)}});
  const std::string blob = read_file(path);
  std::vector<size_t> pos;
  for (const char* n : {"\"z\"", "\"m\"", "\"h\"", "\"a\"", "\"b\""}) pos.push_back(blob.find(n));
  EXPECT_TRUE(std::is_sorted(pos.begin(), pos.end())) << blob.substr(0, 200);
}

TEST_F(SafetensorsTest, SaveRejectsBadInput) {
  const std::string path = dir_ + "/x.safetensors";
  EXPECT_THROW(save_safetensors(path, {{"a", torch::ones(1)}, {"a", torch::ones(1)}}),
               InputError);
  EXPECT_THROW(save_safetensors(path, {{"__metadata__", torch::ones(1)}}), InputError);
  EXPECT_THROW(save_safetensors(path, {{"c", torch::ones(2, torch::kComplexFloat)}}),
               InputError);
  EXPECT_THROW(save_safetensors(path, {{"u", torch::Tensor()}}), InputError);
  EXPECT_FALSE(fs::exists(path));
}

TEST_F(SafetensorsTest, CorruptFilesAreInputErrors) {
  const std::string good = dir_ + "/good.safetensors";
  save_safetensors(good, {{"w", torch::arange(4, torch::kFloat)}});
  const std::string blob = read_file(good);

  const std::string truncated = dir_ + "/truncated.safetensors";
  atomic_write_file(truncated, blob.substr(0, blob.size() - 1));
  expect_bad(truncated, "data area");

  const std::string tiny = dir_ + "/tiny.safetensors";
  atomic_write_file(tiny, std::string("\x01\x02", 2));
  expect_bad(tiny, "too short");

  const std::string w = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string data8(8, '\0');
  expect_bad(write_raw("past_end.st", w, data8, 1000), "runs past the end");
  expect_bad(write_raw("huge.st", w, data8, 200'000'000), "exceeds the limit");
  expect_bad(write_raw("not_json.st", "{\"w\": [", data8), "not valid JSON");
  expect_bad(write_raw("not_object.st", "[1,2]", data8), "does not start with '{'");
  expect_bad(write_raw("overlap.st",
                       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                       std::string(12, '\0')),
             "contiguous");
  expect_bad(write_raw("gap.st",
                       R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                       R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                       std::string(12, '\0')),
             "contiguous");
  expect_bad(write_raw("extra.st", w, std::string(16, '\0')), "data area");
  expect_bad(write_raw("dtype.st", R"({"w":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})",
                       data8),
             "unknown dtype F33");
  expect_bad(write_raw("u16.st", R"({"w":{"dtype":"U16","shape":[4],"data_offsets":[0,8]}})",
                       data8),
             "no libtorch equivalent");
  expect_bad(write_raw("shape.st", R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})",
                       data8),
             "bytes of data_offsets");
  expect_bad(write_raw("negative.st",
                       R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", data8),
             "non-negative");
  expect_bad(write_raw("overflow.st",
                       R"({"w":{"dtype":"F64","shape":[4294967296,4294967296],)"
                       R"("data_offsets":[0,8]}})",
                       data8),
             "overflows");
  expect_bad(write_raw("reversed.st", R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[8,0]}})",
                       data8),
             "end before");
  expect_bad(write_raw("missing.st", R"({"w":{"dtype":"F32","shape":[2]}})", data8),
             "data_offsets");
  expect_bad(write_raw("meta.st", R"({"__metadata__":{"k":1},"w":{"dtype":"F32","shape":[2],)"
                                  R"("data_offsets":[0,8]}})",
                       data8),
             "not a string");
  expect_bad(write_raw("bool.st", R"({"w":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})",
                       std::string("\x01\x02", 2)),
             "bool byte 2");
  expect_bad(dir_ + "/absent.safetensors", "No such file");
}

// ---- independent check through /usr/bin/python3 -----------------------------------------

int run(const std::string& cmd, std::string* out) { return polytrain::testing::run_command(cmd, out); }

// `read FILE` parses with json+struct only (checking padding, order, offsets) and prints
// {name: {dtype, shape, values}}; `write FILE` writes the reference layout for a fixed set
// of tensors built with torch.
const char* kPythonScript = R"PY(
import json, struct, sys, torch
DT = {"F64": (torch.float64, 12), "F32": (torch.float32, 11), "I64": (torch.int64, 13),
      "I32": (torch.int32, 9), "BF16": (torch.bfloat16, 8), "F16": (torch.float16, 7),
      "I16": (torch.int16, 5), "I8": (torch.int8, 2), "U8": (torch.uint8, 1),
      "BOOL": (torch.bool, 0)}
NAME = {v[0]: k for k, v in DT.items()}

def read(path):
    blob = open(path, "rb").read()
    (n,) = struct.unpack("<Q", blob[:8])
    assert n % 8 == 0, "header not padded to 8"
    text = blob[8:8 + n].decode("utf-8")
    header = json.loads(text)
    assert text.rstrip(" ") == json.dumps(header, separators=(",", ":"), ensure_ascii=False)
    header.pop("__metadata__", None)
    names = list(header)
    assert names == sorted(names, key=lambda k: (-DT[header[k]["dtype"]][1], k)), names
    data, out, end = blob[8 + n:], {}, 0
    for name in names:
        info = header[name]
        b, e = info["data_offsets"]
        assert b == end, (name, b, end)
        end = e
        dtype = DT[info["dtype"]][0]
        raw = bytearray(data[b:e])
        t = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        t = t.reshape(info["shape"])
        out[name] = {"dtype": info["dtype"], "shape": info["shape"],
                     "values": t.double().reshape(-1).tolist()}
    assert end == len(data)
    print(json.dumps(out))

def write(path):
    g = torch.Generator().manual_seed(1)
    tensors = {"emb.weight": torch.randn(4, 3, generator=g),
               "ln.bias": torch.randn(3, generator=g).to(torch.bfloat16),
               "half": torch.randn(2, 2, generator=g).half(),
               "ids": torch.arange(-3, 3), "count": torch.tensor(7, dtype=torch.int32),
               "mask": torch.tensor([True, False]), "empty": torch.zeros(0, 2),
               "f64": torch.tensor([1.0 / 3.0], dtype=torch.float64),
               "bytes": torch.tensor([1, 200], dtype=torch.uint8)}
    names = sorted(tensors, key=lambda k: (-DT[NAME[tensors[k].dtype]][1], k))
    header, chunks, off = {"__metadata__": {"format": "pt"}}, [], 0
    for k in names:
        t = tensors[k].contiguous()
        raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
        header[k] = {"dtype": NAME[t.dtype], "shape": list(t.shape),
                     "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        chunks.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(chunks))
    print(json.dumps({k: {"dtype": NAME[t.dtype], "shape": list(t.shape),
                          "values": t.double().reshape(-1).tolist()} for k, t in tensors.items()}))

{"read": read, "write": write}[sys.argv[1]](sys.argv[2])
)PY";

nlohmann::json run_python(const std::string& dir, const std::string& mode,
                          const std::string& path) {
  const std::string script = dir + "/check.py";
  atomic_write_file(script, std::string(kPythonScript));
  std::string out;
  const int rc = run("/usr/bin/python3 " + script + " " + mode + " " + path + " 2>&1", &out);
  EXPECT_EQ(rc, 0) << out;
  return rc == 0 ? nlohmann::json::parse(out) : nlohmann::json();
}

void expect_matches_json(const NamedTensors& tensors, const nlohmann::json& j) {
  ASSERT_EQ(j.size(), tensors.size()) << j.dump();
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(j.contains(name)) << name;
    EXPECT_EQ(j[name]["shape"].get<std::vector<int64_t>>(), t.sizes().vec()) << name;
    const auto values = j[name]["values"].get<std::vector<double>>();
    const torch::Tensor flat = t.to(torch::kDouble).contiguous().reshape({-1});
    ASSERT_EQ(static_cast<int64_t>(values.size()), flat.numel()) << name;
    for (int64_t i = 0; i < flat.numel(); ++i)
      EXPECT_EQ(values[i], flat[i].item<double>()) << name << "[" << i << "]";
  }
}

TEST_F(SafetensorsTest, PythonReadsWhatWeWrite) {
  PT_SKIP_UNLESS(testing::python_imports("torch"), "/usr/bin/python3 with torch (Debian python3-torch)");
  const auto tensors = sample_tensors();
  const std::string path = dir_ + "/for_python.safetensors";
  save_safetensors(path, tensors, {{"format", "pt"}});
  expect_matches_json(tensors, run_python(dir_, "read", path));
}

TEST_F(SafetensorsTest, WeReadWhatPythonWritesAndRewriteItByteForByte) {
  PT_SKIP_UNLESS(testing::python_imports("torch"), "/usr/bin/python3 with torch (Debian python3-torch)");
  const std::string path = dir_ + "/from_python.safetensors";
  const nlohmann::json expected = run_python(dir_, "write", path);
  std::map<std::string, std::string> meta;
  const auto loaded = load_safetensors(path, &meta);
  EXPECT_EQ(meta.at("format"), "pt");
  expect_matches_json(loaded, expected);
  const std::string again = dir_ + "/again.safetensors";
  save_safetensors(again, loaded, meta);
  EXPECT_EQ(read_file(again), read_file(path));
}

}  // namespace
}  // namespace polytrain
