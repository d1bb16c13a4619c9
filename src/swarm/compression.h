// How averaging streams carry float32 values (hivemind's compression names). No torch.
//   none         float32, exact
//   fp16         IEEE half (round to nearest even; beyond +-65504 saturates)
//   scaled_fp16  per block of 4096: mean and std as float32, (x - mean) / std as half
//   uint8        blockwise absmax quantisation: per block of 1024 a float32 scale, then
//                round(x / scale * 127) + 128 as one byte (max error scale / 254 per value)
//   int4         blockwise absmax quantisation: per block of 64 a float32 scale, then
//                round(x / scale * 7) + 8 as a nibble, two a byte (max error scale / 14 per
//                value; 0.5625 bytes a value; the 4-bit codec of local-update training)
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace polytrain::hivemind {

enum class Compression { kNone, kFp16, kScaledFp16, kUint8, kInt4 };

/// InputError naming hivemind.compression and the accepted names for anything else.
Compression parse_compression(const std::string& name);
const char* compression_name(Compression c);

/// Bytes that n values take compressed.
size_t compressed_bytes(Compression c, size_t n);
/// Appends n values, compressed, to out.
void compress(Compression c, const float* x, size_t n, std::string& out);
/// Decodes exactly n values from `bytes` into out; false when `bytes` is not
/// compressed_bytes(c, n) long or holds a non-finite scale (a hostile or broken stream).
bool decompress(Compression c, std::string_view bytes, float* out, size_t n);

/// IEEE half <-> float (exposed for tests).
uint16_t float_to_half(float f);
float half_to_float(uint16_t h);

}  // namespace polytrain::hivemind
