// The process grid: world = tp x dp (pipeline reserved as 1), with Megatron's order
// (parallel_state.py): tensor-parallel ranks are adjacent, so a tensor-parallel group sits
// inside a node. World 4, tp 2: TP groups {0,1},{2,3}; DP groups {0,2},{1,3}. The arithmetic is
// pure (GridShape, coordinates, members); ProcessGroups builds the sub-communicators from it
// (torchtitan's ParallelDims, picotron's process_group_manager).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace polytrain {

class Communicator;

struct GridShape {
  int64_t world = 1;
  int64_t tp = 1;  ///< tensor-parallel size (trainer.model_parallel_size)
  int64_t dp = 1;  ///< data-parallel size
  int64_t pp = 1;  ///< pipeline: reserved, always 1
};

/// world = tp x dp x pp; InputError naming the numbers when tp does not divide the world.
GridShape make_grid_shape(int64_t world, int64_t tp);

struct GridCoord {
  int64_t tp_rank = 0;
  int64_t dp_rank = 0;
};

/// Where `rank` sits: tp_rank = rank % tp, dp_rank = rank / tp.
GridCoord grid_coord(const GridShape& g, int64_t rank);

/// Global ranks of `rank`'s tensor-parallel group (its dp row) and data-parallel group (its
/// tp column), each in increasing order.
std::vector<int64_t> tp_group_members(const GridShape& g, int64_t rank);
std::vector<int64_t> dp_group_members(const GridShape& g, int64_t rank);

/// The named sub-communicators of this rank, split from the world communicator (collective:
/// every rank calls it). A group of size 1 is still a communicator (collectives are no-ops).
struct ProcessGroups {
  GridShape shape;
  GridCoord coord;
  std::unique_ptr<Communicator> tp_group;
  std::unique_ptr<Communicator> dp_group;
};
ProcessGroups make_process_groups(Communicator& world, int64_t tp);

}  // namespace polytrain
