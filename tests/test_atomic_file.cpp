// atomic_write_file / read_file / fsync_dir: content, replacement, and that every failure
// leaves the previous file intact with no temporary file behind.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <ostream>
#include <stdexcept>
#include <string>

#include "polytrain/common/atomic_file.h"
#include "polytrain/common/error.h"
#include "helpers/temp_dir.h"

namespace polytrain {
namespace {

namespace fs = std::filesystem;

class AtomicFileTest : public ::testing::Test {
 protected:
  // Files in dir_ other than the named ones (e.g. a leftover temp file).
  int entries() const {
    int n = 0;
    for (const auto& e : fs::directory_iterator(dir_)) (void)e, ++n;
    return n;
  }

  testing::TempDir tmp_{"pt_atomic"};
  const std::string dir_ = tmp_.str();
};

TEST_F(AtomicFileTest, WritesAndReplacesContent) {
  const std::string path = dir_ + "/a.bin";
  std::string bytes("x\0y\n", 4);
  atomic_write_file(path, bytes);
  EXPECT_EQ(read_file(path), bytes);
  atomic_write_file(path, std::string("second"));
  EXPECT_EQ(read_file(path), "second");
  atomic_write_file(path, std::string());
  EXPECT_EQ(read_file(path), "");
  EXPECT_EQ(entries(), 1);
}

TEST_F(AtomicFileTest, StreamingWriterLargeAndSmallPieces) {
  const std::string path = dir_ + "/big.bin";
  std::string expected;
  atomic_write_file(path, [&](std::ostream& os) {
    for (int i = 0; i < 20000; ++i) {  // many small writes through the buffer
      const std::string piece = std::to_string(i) + ",";
      os << piece;
      expected += piece;
    }
    const std::string block(300000, 'z');  // one write larger than the buffer
    os.write(block.data(), static_cast<std::streamsize>(block.size()));
    expected += block;
    os.put('!');
    expected += '!';
  });
  EXPECT_EQ(read_file(path), expected);
  EXPECT_EQ(entries(), 1);
}

TEST_F(AtomicFileTest, FailingWriterLeavesPreviousFileAndNoTemp) {
  const std::string path = dir_ + "/keep.txt";
  atomic_write_file(path, std::string("original"));
  EXPECT_THROW(atomic_write_file(path,
                                 [](std::ostream& os) {
                                   os << std::string(200000, 'p');  // some bytes hit the disk
                                   throw std::runtime_error("writer failed mid-way");
                                 }),
               std::runtime_error);
  EXPECT_EQ(read_file(path), "original");
  EXPECT_EQ(entries(), 1);
  EXPECT_FALSE(fs::exists(path + ".tmp." + std::to_string(::getpid())));
}

TEST_F(AtomicFileTest, WriterExceptionTypePropagatesUnchanged) {
  const std::string path = dir_ + "/new.txt";
  EXPECT_THROW(atomic_write_file(path, [](std::ostream&) { throw InputError("bad"); }),
               InputError);
  EXPECT_FALSE(fs::exists(path));
  EXPECT_EQ(entries(), 0);
}

TEST_F(AtomicFileTest, RenameFailureThrowsInternalErrorAndCleansUp) {
  // Renaming a file over a non-empty directory fails (EISDIR/ENOTEMPTY).
  const std::string path = dir_ + "/occupied";
  fs::create_directory(path);
  atomic_write_file(path + "/inner", std::string("i"));
  try {
    atomic_write_file(path, std::string("data"));
    FAIL() << "expected InternalError";
  } catch (const InternalError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  EXPECT_EQ(entries(), 1);  // only the directory
}

TEST_F(AtomicFileTest, MissingDirectoryIsInputError) {
  const std::string path = dir_ + "/no/such/dir/f.txt";
  try {
    atomic_write_file(path, std::string("x"));
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

TEST_F(AtomicFileTest, ReadFileErrorsNameTheFile) {
  const std::string missing = dir_ + "/missing.txt";
  try {
    read_file(missing);
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
  EXPECT_THROW(read_file(dir_), InputError);  // a directory
}

TEST_F(AtomicFileTest, FsyncDir) {
  EXPECT_NO_THROW(fsync_dir(dir_));
  EXPECT_THROW(fsync_dir(dir_ + "/absent"), InputError);
}

TEST(ParentDir, Cases) {
  EXPECT_EQ(parent_dir("file"), ".");
  EXPECT_EQ(parent_dir("/file"), "/");
  EXPECT_EQ(parent_dir("a/b/c.txt"), "a/b");
  EXPECT_EQ(parent_dir("/x/y"), "/x");
}

TEST(AtomicFileRelative, BareFileNameUsesCurrentDirectory) {
  testing::TempDir tmp{"pt_atomic_cwd"};
  const fs::path old = fs::current_path();
  fs::current_path(tmp.path);
  atomic_write_file("plain.txt", std::string("here"));
  EXPECT_EQ(read_file("plain.txt"), "here");
  fs::current_path(old);
}

}  // namespace
}  // namespace polytrain
