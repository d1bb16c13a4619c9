// CRC-32C against published vectors (RFC 3720 B.4, the "123456789" check value), the
// TFRecord mask, and the SSE4.2 path against the table path on random data.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "polytrain/common/crc32c.h"

namespace polytrain {
namespace {

uint32_t crc_of(const std::string& s) { return crc32c(s.data(), s.size()); }

TEST(Crc32c, KnownVectors) {
  EXPECT_EQ(crc_of("123456789"), 0xE3069283u);
  EXPECT_EQ(crc_of(""), 0u);
  EXPECT_EQ(crc_of("a"), 0xC1D04330u);
  // RFC 3720 (iSCSI) appendix B.4.
  std::vector<unsigned char> buf(32, 0x00);
  EXPECT_EQ(crc32c(buf.data(), buf.size()), 0x8A9136AAu);
  std::fill(buf.begin(), buf.end(), 0xFF);
  EXPECT_EQ(crc32c(buf.data(), buf.size()), 0x62A8AB43u);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<unsigned char>(i);
  EXPECT_EQ(crc32c(buf.data(), buf.size()), 0x46DD794Eu);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<unsigned char>(31 - i);
  EXPECT_EQ(crc32c(buf.data(), buf.size()), 0x113FDB5Cu);
}

TEST(Crc32c, PortablePathMatchesVectors) {
  const std::string s = "123456789";
  EXPECT_EQ(detail::crc32c_portable(s.data(), s.size()), 0xE3069283u);
  std::vector<unsigned char> buf(32);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<unsigned char>(i);
  EXPECT_EQ(detail::crc32c_portable(buf.data(), buf.size()), 0x46DD794Eu);
}

TEST(Crc32c, ExtendingEqualsWhole) {
  const std::string a = "hello, ", b = "tensorboard world";
  const std::string ab = a + b;
  EXPECT_EQ(crc32c(b.data(), b.size(), crc_of(a)), crc_of(ab));
  EXPECT_EQ(detail::crc32c_portable(b.data(), b.size(), crc_of(a)), crc_of(ab));
}

TEST(Crc32c, HardwareAndTableAgreeOnRandomData) {
  std::mt19937 rng(42);
  std::vector<unsigned char> buf(1100);
  for (auto& c : buf) c = static_cast<unsigned char>(rng());
  for (size_t start = 0; start < 8; ++start)  // every alignment
    for (size_t n = 0; n + start <= buf.size(); n += 1 + n / 3)
      ASSERT_EQ(crc32c(buf.data() + start, n), detail::crc32c_portable(buf.data() + start, n))
          << "start " << start << " n " << n;
}

TEST(Crc32c, Mask) {
  // ((c >> 15) | (c << 17)) + 0xa282ead8 mod 2^32 for 0xE3069283: rotation 0x2507C60D.
  EXPECT_EQ(mask_crc32c(0xE3069283u), 0xC78AB0E5u);
  EXPECT_EQ(mask_crc32c(0u), 0xA282EAD8u);
  const std::string s = "123456789";
  EXPECT_EQ(masked_crc32c(s.data(), s.size()), mask_crc32c(0xE3069283u));
}

}  // namespace
}  // namespace polytrain
