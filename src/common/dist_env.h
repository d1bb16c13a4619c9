// Where a worker learns its place in the job: torchrun/DeepSpeed variables (RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), else Open MPI's
// OMPI_COMM_WORLD_*, else MPICH/Hydra's PMI_*, else Slurm's SLURM_*. Header-only and
// torch-free so that launcher-side tools and tests can use it too.
#pragma once

#include <cerrno>
#include <cstdlib>
#include <string>

#include "polytrain/common/error.h"

namespace polytrain {

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source = "none";  ///< torchrun, openmpi, pmi, slurm, none
};

namespace detail {
inline bool env_int(const char* name, int& out, int min_value) {
  const char* v = std::getenv(name);
  if (!v || !*v) return false;
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  if (errno || *end || x < min_value || x > 1 << 30) {
    throw InputError(cat("environment variable ", name, "='", v, "' is not an integer >= ", min_value));
  }
  out = static_cast<int>(x);
  return true;
}
}  // namespace detail

/// Reads the first complete set of variables found (see the file comment). Values that are
/// not integers, or a rank outside [0, world size), are an InputError naming the variable.
inline DistEnv read_dist_env() {
  DistEnv e;
  using detail::env_int;
  struct Names {
    const char *rank, *size, *local_rank, *local_size, *source;
  };
  const Names sets[] = {
      {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "torchrun"},
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "openmpi"},
      {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "pmi"},
      {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "slurm"},
  };
  for (const auto& s : sets) {
    int r = 0, w = 1;
    const bool has_rank = env_int(s.rank, r, 0);
    const bool has_size = env_int(s.size, w, 1);
    if (!has_rank && !has_size) continue;
    if (!has_size) w = 1;
    if (r >= w) throw InputError(detail::cat(s.rank, "=", r, " is not below ", s.size, "=", w));
    e.rank = r, e.world_size = w, e.source = s.source;
    e.local_rank = r, e.local_world_size = w;
    env_int(s.local_rank, e.local_rank, 0);
    env_int(s.local_size, e.local_world_size, 1);
    break;
  }
  if (const char* a = std::getenv("MASTER_ADDR"); a && *a) e.master_addr = a;
  detail::env_int("MASTER_PORT", e.master_port, 1);
  return e;
}

}  // namespace polytrain
