// Block-wise dynamic 8-bit quantization of optimizer state (Dettmers et al. 2021, "8-bit
// Optimizers via Block-wise Quantization", the scheme of bitsandbytes' 8-bit optimizers):
// the dynamic ("tree") code of 256 values, and a tensor of state cut into blocks of 256
// elements, each stored as 256 one-byte indices into the code plus one fp32 scale (the
// block's largest magnitude). Written here from the paper's description; no bitsandbytes code.
//
// This file holds the codes, the reference quantize / dequantize (plain loops, used by
// checkpoints, statistic() and the tests), the lookup tables that make the nearest-code
// search two table reads, and the register-sized tables of the search without a gather (the
// AVX-512 kernel's); the fused optimizer kernels that use them are cpu_optim_8bit.h's.
// Torch-free.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace polytrain::quant8 {

/// Elements per block: one fp32 absmax for each 256 codes, as bitsandbytes' 8-bit optimizers
/// since version 0.44 (Optimizer2State.init_state: blocksize = 256; the paper and earlier
/// versions used 2048). Smaller blocks track the moments' local scale more closely (a block of
/// 2048 spans several rows of a weight matrix, whose gradients can differ by orders of
/// magnitude) for 4 more bytes of scale a 256 parameters per moment: 2.03 bytes of state a
/// parameter instead of 2.004.
constexpr int64_t kBlockSize = 256;

/// The block of earlier polytrain checkpoints (and of the paper): what an archive's number of
/// scales says it was saved with when it fits this and not kBlockSize (optimizers_8bit.h).
constexpr int64_t kLegacyBlockSize = 2048;

/// Blocks of n elements (the last one may be partial).
constexpr int64_t num_blocks(int64_t n, int64_t block = kBlockSize) { return (n + block - 1) / block; }

/// The search tables cover |x| in [2^-24, 2): 25 binades of 128 buckets each (the float's
/// exponent and top 7 mantissa bits). Below, everything rounds to 0; above, to the largest code.
constexpr int32_t kBucketBase = (127 - 24) << 7;  ///< (biased exponent << 7) of bucket 0
constexpr int32_t kBuckets = 25 * 128;

/// One 256-value code, sorted ascending, and its search tables.
///
/// The dynamic code (the paper's Figure 2; bitsandbytes' create_dynamic_map): after the sign
/// bit, E zero bits give the decimal exponent 10^-E (E = 0..6), the next (indicator) bit is 1,
/// and the remaining 6 - E bits are a linear fraction: 2^(6-E) values at the midpoints of
/// 2^(6-E) equal intervals of [0.1, 1], times 10^-E. The two bit patterns left over hold 0 and
/// 1.0 (bitsandbytes appends both). The signed code (first moment) has 127 positive values,
/// their 127 negatives, 0 and 1.0 (so -1.0 is not in it: its most negative value is
/// -0.99296875); the unsigned code (second moment) uses the sign bit as one more fraction bit:
/// 2^(7-E) values a decade, 254 in all, plus 0 and 1.0.
///
/// The values are computed in float by a formula the SIMD kernels evaluate lane-wise (no table
/// gather on the update's critical path): for magnitude index w (|index - 127| signed, index + 1
/// unsigned), e = floor(log2 w) - shift (shift 0 signed, 1 unsigned), k = w - 2^(e + shift),
/// value = fma(slope[e], k, first[e]) for e in [0, 7) (decade 10^(e-6): first its first value,
/// slope its spacing), 1.0 for e = 7, 0 for e < 0. Each value is within 2 ulp of the formula
/// above evaluated exactly; `values` holds exactly what the kernels compute.
struct DynamicCode {
  bool is_signed = true;
  std::array<float, 256> values{};  ///< ascending; the byte stored is the index
  std::array<float, 8> slope{}, first{};  ///< the formula's per-e constants (slope 0, first 1 at e = 7)
  int shift = 0;                    ///< 0 signed, 1 unsigned
  int zero_index = 0;               ///< values[zero_index] == 0 (127 signed, 0 unsigned)
  /// Magnitude side: values[zero_index + k] for k in [0, max_positive], -values[zero_index - k]
  /// for k in [0, max_negative] (0 for the unsigned code: a negative input rounds to 0).
  int max_positive = 0, max_negative = 0;
  /// Per bucket: (c << 17) | t, where c is the number of thresholds below the bucket and t the
  /// low 16 bits of the threshold inside the bucket (0x10000 when none). A magnitude a in the
  /// bucket has magnitude index c + (low16(a) > t): at most one threshold falls in a bucket
  /// (checked when the tables are built), and within a bucket float order is low-bit order.
  std::array<int32_t, kBuckets> buckets{};

  /// The gather-free search (the AVX-512 kernel's; fast_magnitude below), from register-sized
  /// tables. Decade d = e + 1 (0: the zero value, 1..7: e = 0..6, 8: 1.0) covers the magnitudes
  /// between two decade thresholds, and inside it the magnitude index is
  /// min(round(fma(a, inv_slope[d], offset[d])), top[d]): offset = base - first / slope, base
  /// the magnitude index of the decade's first value, top its last. Which decade: binade j of a
  /// (a in [2^(j-24), 2^(j-23)), everything below in binade 0) starts in decade binade_decade[j]
  /// and a > binade_edge[j] moves it to the next (at most one decade threshold per binade;
  /// +inf when none).
  std::array<float, 16> inv_slope{}, offset{}, top{};
  std::array<int32_t, 32> binade_decade{};
  std::array<float, 32> binade_edge{};
};

/// fast_magnitude's t is trusted when it lies at least this far (in steps of the code) from a
/// midpoint. The roundings between t and the exact midpoints (the fma, offset, 1 / slope and
/// the code's own values) move t by about 2^-15 at most (t < 256), and the test in
/// test_optim_8bit.cpp checks every float in [0, 1]; a t within the margin of k + 1/2 (about
/// one lane in 2000) is left to the table search.
constexpr float kFastMargin = 1.0f / 4096.0f;

/// The signed dynamic code (bitsandbytes: create_dynamic_map(signed=True)), built once.
const DynamicCode& signed_code();
/// The unsigned dynamic code (create_dynamic_map(signed=False)), built once.
const DynamicCode& unsigned_code();

/// Builds a dynamic code from the formula above (what signed_code() / unsigned_code() return).
DynamicCode make_dynamic_code(bool is_signed);

/// Index of the code value nearest to x (x normalised to about [-1, 1]); an exact tie goes to
/// the value nearer zero. Two table reads; the SIMD kernels compute the same thing lane-wise.
inline uint8_t nearest_index(const DynamicCode& c, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t mag = bits & 0x7FFFFFFFu;
  int32_t b = static_cast<int32_t>(mag >> 16) - kBucketBase;
  b = b < 0 ? 0 : (b >= kBuckets ? kBuckets - 1 : b);
  const int32_t e = c.buckets[static_cast<size_t>(b)];
  int k = (e >> 17) + (static_cast<int32_t>(mag & 0xFFFFu) > (e & 0x1FFFF) ? 1 : 0);
  if ((bits >> 31) != 0) {
    k = k < c.max_negative ? k : c.max_negative;
    return static_cast<uint8_t>(c.zero_index - k);
  }
  return static_cast<uint8_t>(c.zero_index + k);
}

/// The magnitude index of a >= 0 (as nearest_index's k) from the gather-free tables, or -1
/// when a lies within kFastMargin of a midpoint inside a decade (then nearest_index decides).
/// The AVX-512 kernel computes the same thing lane-wise.
inline int fast_magnitude(const DynamicCode& c, float a) {
  uint32_t bits;
  std::memcpy(&bits, &a, sizeof(bits));
  const int32_t j = std::max<int32_t>(static_cast<int32_t>(bits >> 23) - (kBucketBase >> 7), 0) & 31;
  const int d = c.binade_decade[static_cast<size_t>(j)] + (a > c.binade_edge[static_cast<size_t>(j)] ? 1 : 0);
  const float t = std::fma(a, c.inv_slope[static_cast<size_t>(d)], c.offset[static_cast<size_t>(d)]);
  const float r = std::nearbyint(t);
  if (std::fabs(t - r) > 0.5f - kFastMargin) return -1;
  return static_cast<int>(std::min(r, c.top[static_cast<size_t>(d)]));
}

/// values[index], evaluated by the formula (what make_dynamic_code fills the table with).
float code_value(const DynamicCode& c, int index);

/// Block-wise quantization of x[0, n): per block of `block` elements, absmax = max |x_i| (0 for
/// an all-zero block) and each code = nearest_index(x_i * (1 / absmax)) (the reciprocal in fp32;
/// 0 when absmax is 0). `codes` has n bytes, `absmax` num_blocks(n, block) floats. Non-finite
/// inputs are unsupported.
void quantize_blockwise(const DynamicCode& code, const float* x, int64_t n, uint8_t* codes, float* absmax,
                        int64_t block = kBlockSize);

/// out_i = values[codes_i] * absmax[block of i].
void dequantize_blockwise(const DynamicCode& code, const uint8_t* codes, const float* absmax, int64_t n, float* out,
                          int64_t block = kBlockSize);

}  // namespace polytrain::quant8
