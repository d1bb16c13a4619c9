// CRC-32C (Castagnoli), as used by TFRecord framing in TensorBoard event files, and its
// "masked" form. Only the checksum: framing and file formats live with their writers
// (trainer/tensorboard.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

namespace polytrain {

/// CRC-32C of n bytes, continuing from `crc` (0 to start; pass a previous result to extend).
/// crc32c("123456789", 9) == 0xE3069283. Uses SSE4.2 when the CPU has it, tables otherwise.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

/// TFRecord's masked CRC: rotate right by 15 and add 0xa282ead8, so that a CRC stored
/// inside checksummed data does not checksum to a fixed value.
uint32_t mask_crc32c(uint32_t crc);

/// mask_crc32c(crc32c(data, n)).
uint32_t masked_crc32c(const void* data, size_t n);

namespace detail {
/// The table-driven path alone, whatever the CPU; for tests that compare both paths.
uint32_t crc32c_portable(const void* data, size_t n, uint32_t crc = 0);
}  // namespace detail

}  // namespace polytrain
