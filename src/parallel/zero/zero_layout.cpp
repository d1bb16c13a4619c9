// ZeroLayout: offsets, padding, and the parameter slices of a flat range.
#include "polytrain/parallel/zero/zero_layout.h"

#include <algorithm>

#include "polytrain/common/error.h"

namespace polytrain {

ZeroLayout make_zero_layout(const std::vector<std::string>& names, const std::vector<std::vector<int64_t>>& shapes,
                            int64_t ranks) {
  PT_CHECK(names.size() == shapes.size(), "zero layout: ", names.size(), " names for ", shapes.size(), " shapes");
  PT_CHECK(ranks >= 1, "zero layout: ranks must be >= 1, got ", ranks);
  ZeroLayout l;
  l.ranks = ranks;
  for (size_t i = 0; i < names.size(); ++i) {
    ZeroLayout::Entry e;
    e.name = names[i];
    e.shape = shapes[i];
    e.numel = 1;
    for (int64_t d : e.shape) e.numel *= d;
    e.offset = l.total;
    l.total += e.numel;
    l.entries.push_back(std::move(e));
  }
  const int64_t unit = ranks * kZeroAlign;
  l.padded = std::max<int64_t>(unit, (l.total + unit - 1) / unit * unit);
  l.part = l.padded / ranks;
  return l;
}

std::vector<ZeroLayout::Piece> ZeroLayout::pieces(int64_t begin, int64_t end) const {
  std::vector<Piece> out;
  // First entry ending after `begin` (entries are sorted by offset).
  auto it = std::upper_bound(entries.begin(), entries.end(), begin,
                             [](int64_t pos, const Entry& e) { return pos < e.offset + e.numel; });
  for (; it != entries.end() && it->offset < end; ++it) {
    const int64_t lo = std::max(begin, it->offset), hi = std::min(end, it->offset + it->numel);
    if (hi <= lo) continue;  // an empty parameter
    out.push_back(Piece{static_cast<size_t>(it - entries.begin()), lo - it->offset, lo, hi - lo});
  }
  return out;
}

int64_t ZeroLayout::owned_elements(int64_t rank) const {
  const int64_t lo = begin_of(rank), hi = std::min(total, lo + part);
  return std::max<int64_t>(0, hi - lo);
}

}  // namespace polytrain
