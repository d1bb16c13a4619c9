// torchrun's flag names on `launch`: each one either maps onto launch's own options or is
// refused with one line naming the polytrain equivalent. Pure: tests give it samples
// (tests/test_launcher.cpp); launch_main.cpp binds the flags and applies the result.
#pragma once

#include <string>

#include "polytrain/launcher/runners.h"

namespace polytrain::launcher {

/// What torchrun's names were given as, "" when not given.
struct TorchrunNames {
  std::string nproc_per_node;  ///< --nproc_per_node N (= --num_gpus)
  std::string nnodes;          ///< --nnodes N (= --num_nodes; an elastic range N:M is refused)
  std::string rdzv_endpoint;   ///< --rdzv_endpoint HOST[:PORT] (= --master_addr, --master_port)
  bool have_hostfile = false;  ///< a hostfile is given or exists at the default path
  int default_procs = 1;       ///< launch's processes per host without --num_gpus (this machine's GPUs, else 1)
};

/// Applies `t` to `o`. --node_rank K (given without --no_ssh by a user, not by a multi-node
/// launch) starts only node K's ranks: with a hostfile, host K's (as --no_ssh); without one,
/// torchrun's static rendezvous: K of --nnodes nodes of --nproc_per_node ranks each, meeting at
/// --master_addr, which every node is given. InputError (one line) for what has no equivalent.
void apply_torchrun_names(const TorchrunNames& t, LaunchOptions& o);

}  // namespace polytrain::launcher
