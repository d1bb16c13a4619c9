// The ranks one launcher starts on this machine as one MPI job, without mpirun: the launcher is
// their PMIx server, as Slurm or Flux is for the MPI programs they start directly. Open MPI then
// wires the ranks through its shared-memory transport, several times Gloo's loopback TCP on one
// host (docs/parallelism.md, "Collectives on one host"), and `comm_backend: auto` picks it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "polytrain/launcher/env_file.h"

namespace polytrain::launcher {

class LocalMpiWorld {
 public:
  /// The job of `nprocs` local ranks for the launch attempt `attempt` (each restart is a new
  /// job). nullptr, with `why` set, when this build has no PMIx or its server cannot start;
  /// the workers then get no MPI world and auto picks Gloo.
  static std::unique_ptr<LocalMpiWorld> create(int nprocs, int attempt, std::string& why);
  ~LocalMpiWorld();  ///< ends the job (the server stays up for the next attempt)
  LocalMpiWorld(const LocalMpiWorld&) = delete;
  LocalMpiWorld& operator=(const LocalMpiWorld&) = delete;

  /// What local rank `i` needs in its environment to join: the PMIx server's address and the
  /// rank's identity, plus what makes Open MPI 4 take itself for directly launched.
  const EnvList& env(int i) const { return env_.at(static_cast<size_t>(i)); }

 private:
  LocalMpiWorld() = default;
  std::string nspace_;
  std::vector<EnvList> env_;
  /// Open MPI's files for this job (shared-memory segments, session folder): removed with the
  /// job, so that ranks killed before MPI_Finalize leave nothing in /dev/shm or /tmp.
  std::vector<std::string> job_dirs_;
};

/// Whether this launcher was built with a PMIx server.
bool mpi_world_supported();

}  // namespace polytrain::launcher
