#include "polytrain/swarm/compression.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "polytrain/common/error.h"

namespace polytrain::hivemind {
namespace {

constexpr size_t kScaledBlock = 4096;
constexpr size_t kUint8Block = 1024;
// int4: 64 values a block (one fp32 scale per 64 values: 0.5625 bytes a value), the block size
// 4-bit blockwise codecs use, so that one large value costs the precision of 63 others only.
constexpr size_t kInt4Block = 64;

// Writes the block's absmax (the scale of uint8 and int4) as 4 bytes at p and returns it; a
// block with a non-finite value gets 0, so it is sent as zeros.
float put_absmax(const float* x, size_t k, char* p) {
  float amax = 0.0f;
  for (size_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(x[i]));
  if (!std::isfinite(amax)) amax = 0.0f;
  std::memcpy(p, &amax, 4);
  return amax;
}

// Bytes of one int4 block of k values: its scale and two values a byte.
size_t int4_block_bytes(size_t k) { return 4 + (k + 1) / 2; }

size_t blocks(size_t n, size_t b) { return (n + b - 1) / b; }

#if defined(__x86_64__)
__attribute__((target("f16c,avx"))) void to_half_f16c(const float* x, size_t n, uint16_t* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) out[i] = float_to_half(x[i]);
}
__attribute__((target("f16c,avx"))) void from_half_f16c(const uint16_t* h, size_t n, float* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  for (; i < n; ++i) out[i] = half_to_float(h[i]);
}
bool has_f16c() {
  static const bool yes = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
  return yes;
}
#endif

void to_half(const float* x, size_t n, uint16_t* out) {
#if defined(__x86_64__)
  if (has_f16c()) return to_half_f16c(x, n, out);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = float_to_half(x[i]);
}

void from_half(const uint16_t* h, size_t n, float* out) {
#if defined(__x86_64__)
  if (has_f16c()) return from_half_f16c(h, n, out);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = half_to_float(h[i]);
}

float clamp_half(float v) { return std::max(-65504.0f, std::min(65504.0f, v)); }

}  // namespace

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t mag = x & 0x7fffffffu;
  if (mag >= 0x7f800000u) return static_cast<uint16_t>(sign | (mag > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (mag >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (mag < 0x38800000u) {                                               // subnormal half (or zero)
    if (mag < 0x33000000u) return static_cast<uint16_t>(sign);
    const uint32_t e = mag >> 23;
    const uint32_t m = (mag & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14 + (127 - 15) - e + 1
    uint32_t h = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = ((mag - 0x38000000u) >> 13);
  const uint32_t rem = mag & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  uint32_t x;
  if (e == 0) {
    if (m == 0) {
      x = sign;
    } else {  // subnormal: normalise
      int shift = 0;
      uint32_t mm = m;
      while (!(mm & 0x400u)) mm <<= 1, ++shift;
      x = sign | ((113u - shift) << 23) | ((mm & 0x3ffu) << 13);
    }
  } else if (e == 31) {
    x = sign | 0x7f800000u | (m << 13);
  } else {
    x = sign | ((e + 112u) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

Compression parse_compression(const std::string& name) {
  if (name == "none") return Compression::kNone;
  if (name == "fp16") return Compression::kFp16;
  if (name == "scaled_fp16") return Compression::kScaledFp16;
  if (name == "uint8") return Compression::kUint8;
  if (name == "int4") return Compression::kInt4;
  throw InputError("hivemind.compression '" + name + "': expected none, fp16, scaled_fp16, uint8 or int4");
}

const char* compression_name(Compression c) {
  switch (c) {
    case Compression::kNone: return "none";
    case Compression::kFp16: return "fp16";
    case Compression::kScaledFp16: return "scaled_fp16";
    case Compression::kUint8: return "uint8";
    case Compression::kInt4: return "int4";
  }
  return "?";
}

size_t compressed_bytes(Compression c, size_t n) {
  switch (c) {
    case Compression::kNone: return 4 * n;
    case Compression::kFp16: return 2 * n;
    case Compression::kScaledFp16: return 2 * n + 8 * blocks(n, kScaledBlock);
    case Compression::kUint8: return n + 4 * blocks(n, kUint8Block);
    case Compression::kInt4:
      return (n / kInt4Block) * int4_block_bytes(kInt4Block) + (n % kInt4Block ? int4_block_bytes(n % kInt4Block) : 0);
  }
  return 0;
}

void compress(Compression c, const float* x, size_t n, std::string& out) {
  const size_t start = out.size();
  out.resize(start + compressed_bytes(c, n));
  char* p = out.data() + start;
  switch (c) {
    case Compression::kNone:
      std::memcpy(p, x, 4 * n);
      return;
    case Compression::kFp16: {
      std::vector<float> clamped(x, x + n);
      for (float& v : clamped) v = clamp_half(v);
      to_half(clamped.data(), n, reinterpret_cast<uint16_t*>(p));
      return;
    }
    case Compression::kScaledFp16: {
      std::vector<float> buf(kScaledBlock);
      for (size_t b = 0; b * kScaledBlock < n; ++b) {
        const size_t lo = b * kScaledBlock, k = std::min(kScaledBlock, n - lo);
        double sum = 0, sq = 0;
        for (size_t i = 0; i < k; ++i) sum += x[lo + i];
        const double mean = sum / static_cast<double>(k);
        for (size_t i = 0; i < k; ++i) sq += (x[lo + i] - mean) * (x[lo + i] - mean);
        double sd = std::sqrt(sq / static_cast<double>(k));
        if (!(sd > 1e-30)) sd = 1.0;
        const float fm = static_cast<float>(mean), fs = static_cast<float>(sd);
        std::memcpy(p, &fm, 4), std::memcpy(p + 4, &fs, 4);
        p += 8;
        for (size_t i = 0; i < k; ++i) buf[i] = clamp_half(static_cast<float>((x[lo + i] - mean) / sd));
        to_half(buf.data(), k, reinterpret_cast<uint16_t*>(p));
        p += 2 * k;
      }
      return;
    }
    case Compression::kUint8: {
      for (size_t b = 0; b * kUint8Block < n; ++b) {
        const size_t lo = b * kUint8Block, k = std::min(kUint8Block, n - lo);
        const float amax = put_absmax(x + lo, k, p);
        p += 4;
        const float inv = amax > 0 ? 127.0f / amax : 0.0f;
        for (size_t i = 0; i < k; ++i) {
          const float q = std::nearbyint(std::max(-127.0f, std::min(127.0f, x[lo + i] * inv)));
          p[i] = static_cast<char>(static_cast<uint8_t>(static_cast<int>(q) + 128));
        }
        p += k;
      }
      return;
    }
    case Compression::kInt4: {
      for (size_t lo = 0; lo < n; lo += kInt4Block) {
        const size_t k = std::min(kInt4Block, n - lo);
        const float amax = put_absmax(x + lo, k, p);
        p += 4;
        const float inv = amax > 0 ? 7.0f / amax : 0.0f;
        std::memset(p, 0, (k + 1) / 2);
        for (size_t i = 0; i < k; ++i) {  // round(x / amax * 7) + 8 in 1..15, low nibble first
          const int q = static_cast<int>(std::nearbyint(std::max(-7.0f, std::min(7.0f, x[lo + i] * inv)))) + 8;
          p[i / 2] = static_cast<char>(static_cast<uint8_t>(p[i / 2]) | (q << (4 * (i % 2))));
        }
        p += (k + 1) / 2;
      }
      return;
    }
  }
}

bool decompress(Compression c, std::string_view bytes, float* out, size_t n) {
  if (bytes.size() != compressed_bytes(c, n)) return false;
  const char* p = bytes.data();
  switch (c) {
    case Compression::kNone:
      std::memcpy(out, p, 4 * n);
      return true;
    case Compression::kFp16: {
      std::vector<uint16_t> h(n);
      std::memcpy(h.data(), p, 2 * n);
      from_half(h.data(), n, out);
      return true;
    }
    case Compression::kScaledFp16: {
      std::vector<uint16_t> h(kScaledBlock);
      for (size_t b = 0; b * kScaledBlock < n; ++b) {
        const size_t lo = b * kScaledBlock, k = std::min(kScaledBlock, n - lo);
        float mean, sd;
        std::memcpy(&mean, p, 4), std::memcpy(&sd, p + 4, 4);
        if (!std::isfinite(mean) || !std::isfinite(sd)) return false;
        p += 8;
        std::memcpy(h.data(), p, 2 * k);
        from_half(h.data(), k, out + lo);
        for (size_t i = 0; i < k; ++i) out[lo + i] = out[lo + i] * sd + mean;
        p += 2 * k;
      }
      return true;
    }
    case Compression::kUint8: {
      for (size_t b = 0; b * kUint8Block < n; ++b) {
        const size_t lo = b * kUint8Block, k = std::min(kUint8Block, n - lo);
        float amax;
        std::memcpy(&amax, p, 4);
        if (!std::isfinite(amax)) return false;
        p += 4;
        const float s = amax / 127.0f;
        for (size_t i = 0; i < k; ++i) out[lo + i] = static_cast<float>(static_cast<int>(static_cast<uint8_t>(p[i])) - 128) * s;
        p += k;
      }
      return true;
    }
    case Compression::kInt4: {
      for (size_t lo = 0; lo < n; lo += kInt4Block) {
        const size_t k = std::min(kInt4Block, n - lo);
        float amax;
        std::memcpy(&amax, p, 4);
        if (!std::isfinite(amax)) return false;
        p += 4;
        const float s = amax / 7.0f;  // a nibble of 0 (never sent) decodes to -8 s: still bounded
        for (size_t i = 0; i < k; ++i)
          out[lo + i] = static_cast<float>(((static_cast<uint8_t>(p[i / 2]) >> (4 * (i % 2))) & 0xF) - 8) * s;
        p += (k + 1) / 2;
      }
      return true;
    }
  }
  return false;
}

}  // namespace polytrain::hivemind
