// Grid arithmetic and the split of the world communicator into TP and DP groups.
#include "polytrain/parallel/process_grid.h"

#include "polytrain/common/error.h"
#include "polytrain/parallel/comm/communicator.h"
#include "polytrain/parallel/parallel_dims.h"

namespace polytrain {

GridShape make_grid_shape(int64_t world, int64_t tp, int64_t pp) {
  PT_INPUT_CHECK(world >= 1, "world size must be >= 1, got ", world);
  const std::string mp_error = model_parallel_error("deepspeed+mpu", tp, world);
  PT_INPUT_CHECK(mp_error.empty(), mp_error);
  const std::string pp_error = pipeline_parallel_error("deepspeed+mpu", pp, tp, world);
  PT_INPUT_CHECK(pp_error.empty(), pp_error);
  return GridShape{world, tp, world / (tp * pp), pp};
}

GridCoord grid_coord(const GridShape& g, int64_t rank) {
  PT_CHECK(rank >= 0 && rank < g.world, "rank ", rank, " outside world ", g.world);
  return GridCoord{rank % g.tp, rank / g.tp % g.dp, rank / (g.tp * g.dp)};
}

int64_t grid_rank(const GridShape& g, const GridCoord& c) { return c.tp_rank + g.tp * (c.dp_rank + g.dp * c.pp_rank); }

std::vector<int64_t> tp_group_members(const GridShape& g, int64_t rank) {
  GridCoord c = grid_coord(g, rank);
  std::vector<int64_t> out;
  for (c.tp_rank = 0; c.tp_rank < g.tp; ++c.tp_rank) out.push_back(grid_rank(g, c));
  return out;
}

std::vector<int64_t> dp_group_members(const GridShape& g, int64_t rank) {
  GridCoord c = grid_coord(g, rank);
  std::vector<int64_t> out;
  for (c.dp_rank = 0; c.dp_rank < g.dp; ++c.dp_rank) out.push_back(grid_rank(g, c));
  return out;
}

std::vector<int64_t> pp_group_members(const GridShape& g, int64_t rank) {
  GridCoord c = grid_coord(g, rank);
  std::vector<int64_t> out;
  for (c.pp_rank = 0; c.pp_rank < g.pp; ++c.pp_rank) out.push_back(grid_rank(g, c));
  return out;
}

ProcessGroups make_process_groups(Communicator& world, int64_t tp, int64_t pp) {
  ProcessGroups pg;
  pg.shape = make_grid_shape(world.size(), tp, pp);
  const GridShape& g = pg.shape;
  const GridCoord c = grid_coord(g, world.rank());
  pg.coord = c;
  // Colour = the group's index, key = the rank's place in it: ordered as *_group_members.
  pg.tp_group = world.split(static_cast<int>(c.dp_rank + g.dp * c.pp_rank), static_cast<int>(c.tp_rank));
  pg.dp_group = world.split(static_cast<int>(c.tp_rank + g.tp * c.pp_rank), static_cast<int>(c.dp_rank));
  if (pp > 1) pg.pp_group = world.split(static_cast<int>(c.tp_rank + g.tp * c.dp_rank), static_cast<int>(c.pp_rank));
  return pg;
}

}  // namespace polytrain
