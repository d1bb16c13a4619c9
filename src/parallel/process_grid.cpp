// Grid arithmetic and the split of the world communicator into TP and DP groups.
#include "polytrain/parallel/process_grid.h"

#include "polytrain/common/error.h"
#include "polytrain/parallel/comm/communicator.h"
#include "polytrain/parallel/parallel_dims.h"

namespace polytrain {

GridShape make_grid_shape(int64_t world, int64_t tp) {
  PT_INPUT_CHECK(world >= 1, "world size must be >= 1, got ", world);
  const std::string mp_error = model_parallel_error("deepspeed+mpu", tp, world);  // the grid is TP x DP
  PT_INPUT_CHECK(mp_error.empty(), mp_error);
  return GridShape{world, tp, world / tp, 1};
}

GridCoord grid_coord(const GridShape& g, int64_t rank) {
  PT_CHECK(rank >= 0 && rank < g.world, "rank ", rank, " outside world ", g.world);
  return GridCoord{rank % g.tp, rank / g.tp};
}

std::vector<int64_t> tp_group_members(const GridShape& g, int64_t rank) {
  const GridCoord c = grid_coord(g, rank);
  std::vector<int64_t> out;
  for (int64_t t = 0; t < g.tp; ++t) out.push_back(c.dp_rank * g.tp + t);
  return out;
}

std::vector<int64_t> dp_group_members(const GridShape& g, int64_t rank) {
  const GridCoord c = grid_coord(g, rank);
  std::vector<int64_t> out;
  for (int64_t d = 0; d < g.dp; ++d) out.push_back(d * g.tp + c.tp_rank);
  return out;
}

ProcessGroups make_process_groups(Communicator& world, int64_t tp) {
  ProcessGroups pg;
  pg.shape = make_grid_shape(world.size(), tp);
  pg.coord = grid_coord(pg.shape, world.rank());
  // Colour = the group's index, key = the rank's place in it: ordered as *_group_members.
  pg.tp_group = world.split(static_cast<int>(pg.coord.dp_rank), static_cast<int>(pg.coord.tp_rank));
  pg.dp_group = world.split(static_cast<int>(pg.coord.tp_rank), static_cast<int>(pg.coord.dp_rank));
  return pg;
}

}  // namespace polytrain
