// What every multi-rank backend does over its communicator besides reducing gradients: start
// from rank 0's weights, share a string from rank 0, average a logged number. Tensors travel
// on `device` (NCCL takes CUDA tensors only).
#pragma once

#include <memory>
#include <string>

#include <c10/core/Device.h>

#include "polytrain/common/torch_fwd.h"

namespace polytrain {

class Communicator;
struct RankContext;
struct TrainerOptions;

/// The world communicator of the launcher's environment for trainer.comm_backend and
/// trainer.comm_timeout, with tensors on `device`.
std::unique_ptr<Communicator> world_communicator(const TrainerOptions& t, const c10::Device& device);

/// A data-parallel world on `comm`: rank, sizes, local rank (environment), data-parallel
/// coordinate = rank, rank 0 writing logs, model and checkpoint marker, and a bare "cuda"
/// device made the local rank's GPU.
void set_data_parallel_context(RankContext& ctx, const Communicator& comm);

/// Every rank's parameters and buffers take rank 0's values (one flat broadcast per dtype).
void broadcast_module_state(Communicator& comm, torch::nn::Module& module);

/// Rank 0's `value` on every rank (collective).
std::string share_from_rank0(Communicator& comm, const c10::Device& device, const std::string& value);

/// The mean of `local_value` over the ranks (collective).
double mean_over_ranks(Communicator& comm, const c10::Device& device, double local_value);

/// The sum of `local_value` over the ranks (collective), in float64.
double sum_over_ranks(Communicator& comm, const c10::Device& device, double local_value);

}  // namespace polytrain
