// Where ZeRO keeps each parameter: one flat buffer per parameter group (weight decay / none),
// the group's trainable parameters in registration order, padded at the end so that it splits
// into `ranks` equal partitions whose sizes are multiples of kZeroAlign elements; rank r owns
// [r * part, (r + 1) * part). A parameter may straddle a partition boundary (each rank holds a
// slice of it: `Piece`), a partition may hold only padding (more ranks than elements). Pure
// arithmetic, no tensors: the checkpoint re-slicing and the tests use it as the backend does.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace polytrain {

/// Partition sizes are multiples of 16 elements: every partition starts on a 64-byte boundary
/// in fp32 (one AVX-512 vector, one cache line), so the CPU Adam never splits a vector.
constexpr int64_t kZeroAlign = 16;

struct ZeroLayout {
  struct Entry {
    std::string name;
    std::vector<int64_t> shape;
    int64_t numel = 0;
    int64_t offset = 0;  ///< first element in the flat buffer
  };
  /// A slice of parameter `entry`: its elements [param_begin, param_begin + length) at flat
  /// position flat_begin.
  struct Piece {
    size_t entry = 0;
    int64_t param_begin = 0;
    int64_t flat_begin = 0;
    int64_t length = 0;
  };

  std::vector<Entry> entries;
  int64_t total = 0;   ///< elements of the parameters
  int64_t padded = 0;  ///< total rounded up to a multiple of ranks * kZeroAlign
  int64_t part = 0;    ///< padded / ranks
  int64_t ranks = 1;

  int64_t begin_of(int64_t rank) const { return rank * part; }
  /// The parameter slices inside flat range [begin, end), in flat order.
  std::vector<Piece> pieces(int64_t begin, int64_t end) const;
  /// The slices rank `rank` owns.
  std::vector<Piece> owned(int64_t rank) const { return pieces(begin_of(rank), begin_of(rank) + part); }
  /// Elements of real parameters (not padding) in rank's partition.
  int64_t owned_elements(int64_t rank) const;
};

/// The layout of parameters `names` with `shapes`, split over `ranks`.
ZeroLayout make_zero_layout(const std::vector<std::string>& names, const std::vector<std::vector<int64_t>>& shapes,
                            int64_t ranks);

}  // namespace polytrain
