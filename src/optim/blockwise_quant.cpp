// The dynamic codes and their search tables (see blockwise_quant.h), and the reference
// block-wise quantize / dequantize loops.
#include "polytrain/optim/blockwise_quant.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "polytrain/common/error.h"

namespace polytrain::quant8 {
namespace {

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

float float_of(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

/// The largest float <= d (d >= 0).
float round_down(double d) {
  float f = static_cast<float>(d);
  if (static_cast<double>(f) > d) f = std::nextafter(f, 0.0f);
  return f;
}

/// The per-decade constants of the code's formula (blockwise_quant.h): decade 10^(e-6) has
/// 2^(e + shift) values at 10^(e-6) (0.1 + 0.9 (k + 0.5) / 2^(e + shift)), k = 0, 1, ...:
/// first = its k = 0 value, slope = 10^(e-6) 0.9 / 2^(e + shift); e = 7 is 1.0.
void decade_constants(DynamicCode& c) {
  for (int e = 0; e < 7; ++e) {
    const double scale = std::pow(10.0, e - 6), intervals = std::ldexp(1.0, e + c.shift);
    c.first[static_cast<size_t>(e)] = static_cast<float>(scale * (0.1 + 0.45 / intervals));
    c.slope[static_cast<size_t>(e)] = static_cast<float>(scale * 0.9 / intervals);
  }
  c.first[7] = 1.0f;
  c.slope[7] = 0.0f;
}

/// The code's non-negative magnitudes, ascending (magnitude index w - shift for w >= 2^shift).
std::vector<float> magnitudes(const DynamicCode& c) {
  std::vector<float> out = {0.0f};
  for (int e = 0; e < 7; ++e)
    for (int k = 0; k < (1 << (e + c.shift)); ++k)
      out.push_back(std::fma(c.slope[static_cast<size_t>(e)], static_cast<float>(k), c.first[static_cast<size_t>(e)]));
  out.push_back(1.0f);
  return out;
}

/// The gather-free search's tables (blockwise_quant.h) from the thresholds t between
/// neighbouring magnitudes (t[m] between magnitude m and m + 1).
void fast_tables(DynamicCode& c, const std::vector<float>& t) {
  // Decade d of magnitude m: 0 for the zero value, e + 1 for decade e, 8 for 1.0.
  std::vector<int> decade_of = {0};
  std::array<int, 9> base{}, count{};
  for (int e = 0; e < 7; ++e) {
    base[static_cast<size_t>(e + 1)] = static_cast<int>(decade_of.size());
    count[static_cast<size_t>(e + 1)] = 1 << (e + c.shift);
    decade_of.insert(decade_of.end(), static_cast<size_t>(1 << (e + c.shift)), e + 1);
  }
  base[8] = static_cast<int>(decade_of.size());
  count[0] = count[8] = 1;
  decade_of.push_back(8);
  PT_CHECK(static_cast<int>(decade_of.size()) == c.max_positive + 1, "dynamic code: decades miscounted");
  for (int d = 0; d < 9; ++d) {
    const size_t i = static_cast<size_t>(d);
    if (d == 0 || d == 8) {  // one value each: t = base
      c.inv_slope[i] = 0.0f;
      c.offset[i] = static_cast<float>(base[i]);
    } else {
      const double slope = c.slope[i - 1], first = c.first[i - 1];
      c.inv_slope[i] = static_cast<float>(1.0 / slope);
      c.offset[i] = static_cast<float>(base[i] - first / slope);
    }
    c.top[i] = static_cast<float>(base[i] + count[i] - 1);
  }
  // The decade thresholds: magnitudes above edge[d] are past decade d.
  std::vector<float> edge;
  for (size_t m = 0; m + 1 < decade_of.size(); ++m)
    if (decade_of[m] != decade_of[m + 1]) edge.push_back(t[m]);
  PT_CHECK(edge.size() == 8, "dynamic code: ", edge.size(), " decade thresholds");
  for (int32_t j = 0; j < 32; ++j) {
    const float lo = float_of(static_cast<uint32_t>((kBucketBase >> 7) + j) << 23);
    const float hi = float_of(static_cast<uint32_t>((kBucketBase >> 7) + j + 1) << 23);
    const int32_t below = static_cast<int32_t>(std::lower_bound(edge.begin(), edge.end(), lo) - edge.begin());
    const int32_t inside = static_cast<int32_t>(std::lower_bound(edge.begin(), edge.end(), hi) - edge.begin()) - below;
    PT_CHECK(inside <= 1, "dynamic code: ", inside, " decade thresholds in one binade");
    c.binade_decade[static_cast<size_t>(j)] = below;
    c.binade_edge[static_cast<size_t>(j)] =
        inside == 1 ? edge[static_cast<size_t>(below)] : std::numeric_limits<float>::infinity();
  }
}

}  // namespace

DynamicCode make_dynamic_code(bool is_signed) {
  DynamicCode c;
  c.is_signed = is_signed;
  c.shift = is_signed ? 0 : 1;
  decade_constants(c);
  const std::vector<float> mag = magnitudes(c);
  PT_CHECK(std::is_sorted(mag.begin(), mag.end()) && std::adjacent_find(mag.begin(), mag.end()) == mag.end(),
           "dynamic code: magnitudes not strictly increasing");
  // Sorted values: the negatives of every magnitude but 0 and 1.0 (signed only), then mag.
  c.max_positive = static_cast<int>(mag.size()) - 1;
  c.max_negative = is_signed ? c.max_positive - 1 : 0;
  c.zero_index = c.max_negative;
  PT_CHECK(c.zero_index + c.max_positive == 255, "dynamic code: ", c.zero_index + c.max_positive + 1, " values, not 256");
  for (int k = 0; k <= c.max_negative; ++k) c.values[static_cast<size_t>(c.zero_index - k)] = -mag[static_cast<size_t>(k)];
  for (int k = 0; k <= c.max_positive; ++k) c.values[static_cast<size_t>(c.zero_index + k)] = mag[static_cast<size_t>(k)];
  c.values[static_cast<size_t>(c.zero_index)] = 0.0f;  // not -0
  for (int i = 0; i < 256; ++i)
    PT_CHECK(code_value(c, i) == c.values[static_cast<size_t>(i)], "dynamic code: value ", i, " differs from its formula");

  // Thresholds between neighbouring magnitudes: a magnitude a goes up past t_k iff a > t_k,
  // where t_k is the largest float <= the exact midpoint (so an exact tie stays nearer zero).
  // The midpoint of two floats is exact in double.
  std::vector<float> t;
  for (size_t k = 0; k + 1 < mag.size(); ++k)
    t.push_back(round_down((static_cast<double>(mag[k]) + static_cast<double>(mag[k + 1])) / 2.0));
  for (int32_t b = 0; b < kBuckets; ++b) {
    const float lo = float_of(static_cast<uint32_t>(b + kBucketBase) << 16);
    const float hi = float_of(static_cast<uint32_t>(b + kBucketBase + 1) << 16);
    const int32_t below = static_cast<int32_t>(std::lower_bound(t.begin(), t.end(), lo) - t.begin());
    const int32_t inside = static_cast<int32_t>(std::lower_bound(t.begin(), t.end(), hi) - t.begin()) - below;
    PT_CHECK(inside <= 1, "dynamic code: ", inside, " thresholds in one search bucket");
    const int32_t low = inside == 1 ? static_cast<int32_t>(bits_of(t[static_cast<size_t>(below)]) & 0xFFFFu) : 0x10000;
    c.buckets[static_cast<size_t>(b)] = (below << 17) | low;
  }
  // Everything below the first bucket must round to 0, and the last bucket hold no threshold.
  PT_CHECK(t.front() >= float_of(static_cast<uint32_t>(kBucketBase) << 16) && t.back() < 1.0f,
           "dynamic code: thresholds outside the search tables' range");
  fast_tables(c, t);
  return c;
}

float code_value(const DynamicCode& c, int index) {
  const int w = c.is_signed ? std::abs(index - c.zero_index) : index + 1;
  if (w < (1 << c.shift)) return 0.0f;
  int e = 0;
  while ((2 << e) <= w) ++e;  // floor(log2 w)
  const float k = static_cast<float>(w - (1 << e));
  e -= c.shift;
  const float mag = std::fma(c.slope[static_cast<size_t>(e)], k, c.first[static_cast<size_t>(e)]);
  return c.is_signed && index < c.zero_index ? -mag : mag;
}

const DynamicCode& signed_code() {
  static const DynamicCode c = make_dynamic_code(true);
  return c;
}

const DynamicCode& unsigned_code() {
  static const DynamicCode c = make_dynamic_code(false);
  return c;
}

void quantize_blockwise(const DynamicCode& code, const float* x, int64_t n, uint8_t* codes, float* absmax,
                        int64_t block) {
  PT_CHECK(block > 0, "quantize_blockwise: block size ", block);
  for (int64_t b = 0; b < num_blocks(n, block); ++b) {
    const int64_t lo = b * block, hi = std::min(n, lo + block);
    float amax = 0.0f;
    for (int64_t i = lo; i < hi; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float inv = amax > 0.0f ? 1.0f / amax : 0.0f;
    for (int64_t i = lo; i < hi; ++i) codes[i] = nearest_index(code, x[i] * inv);
    absmax[b] = amax;
  }
}

void dequantize_blockwise(const DynamicCode& code, const uint8_t* codes, const float* absmax, int64_t n, float* out,
                          int64_t block) {
  PT_CHECK(block > 0, "dequantize_blockwise: block size ", block);
  for (int64_t i = 0; i < n; ++i) out[i] = code.values[codes[i]] * absmax[i / block];
}

}  // namespace polytrain::quant8
