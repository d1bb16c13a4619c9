// The process grid: world = tp x dp x pp, with Megatron's order (parallel_state.py,
// "tp-dp-pp"): tensor-parallel ranks are adjacent, so a tensor-parallel group sits inside a node;
// pipeline stages are outermost. rank = tp_rank + tp x (dp_rank + dp x pp_rank).
// World 4, tp 2: TP groups {0,1},{2,3}; DP groups {0,2},{1,3}. World 8, tp 2, pp 2: stage 0 is
// ranks 0-3, stage 1 ranks 4-7; PP groups {0,4},{1,5},{2,6},{3,7}. The arithmetic is
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
  int64_t pp = 1;  ///< pipeline stages
};

/// world = tp x dp x pp; InputError naming the numbers when tp x pp does not divide the world.
GridShape make_grid_shape(int64_t world, int64_t tp, int64_t pp = 1);

struct GridCoord {
  int64_t tp_rank = 0;
  int64_t dp_rank = 0;
  int64_t pp_rank = 0;
};

/// Where `rank` sits: tp_rank = rank % tp, dp_rank = rank / tp % dp, pp_rank = rank / (tp x dp).
GridCoord grid_coord(const GridShape& g, int64_t rank);
/// The global rank at `c`.
int64_t grid_rank(const GridShape& g, const GridCoord& c);

/// Global ranks of `rank`'s tensor-parallel group (its dp row) and data-parallel group (its
/// tp column), each in increasing order.
std::vector<int64_t> tp_group_members(const GridShape& g, int64_t rank);
std::vector<int64_t> dp_group_members(const GridShape& g, int64_t rank);
/// Global ranks of `rank`'s pipeline (the same tp and dp coordinates at every stage), by stage.
std::vector<int64_t> pp_group_members(const GridShape& g, int64_t rank);

/// The named sub-communicators of this rank, split from the world communicator (collective:
/// every rank calls it). A group of size 1 is still a communicator (collectives are no-ops).
struct ProcessGroups {
  GridShape shape;
  GridCoord coord;
  std::unique_ptr<Communicator> tp_group;
  std::unique_ptr<Communicator> dp_group;
  std::unique_ptr<Communicator> pp_group;
};
ProcessGroups make_process_groups(Communicator& world, int64_t tp, int64_t pp = 1);

}  // namespace polytrain
