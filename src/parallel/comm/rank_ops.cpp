// rank_ops.h: broadcast of a module's state, a string from rank 0, a mean and a sum.
#include "polytrain/parallel/comm/rank_ops.h"

#include <cstring>
#include <map>

#include <torch/nn/module.h>
#include <torch/torch.h>

#include "polytrain/common/config.h"
#include "polytrain/common/dist_env.h"
#include "polytrain/parallel/backend.h"
#include "polytrain/parallel/comm/communicator.h"

namespace polytrain {

std::unique_ptr<Communicator> world_communicator(const TrainerOptions& t, const c10::Device& device) {
  CommOptions o;
  o.engine = t.comm_backend;
  o.timeout = std::chrono::milliseconds(static_cast<int64_t>(t.comm_timeout * 1000));
  o.cuda = device.is_cuda();
  return make_communicator(o);
}

void set_data_parallel_context(RankContext& ctx, const Communicator& comm) {
  const DistEnv env = read_dist_env();
  ctx.rank = comm.rank();
  ctx.world_size = comm.size();
  ctx.local_rank = env.local_rank;
  ctx.dp_rank = ctx.rank;
  ctx.dp_size = ctx.world_size;
  ctx.writes_logs = ctx.writes_model = ctx.commits_checkpoints = ctx.rank == 0;
  if (ctx.device.is_cuda() && !ctx.device.has_index())
    ctx.device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
}

void broadcast_module_state(Communicator& comm, torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  std::map<at::ScalarType, std::vector<at::Tensor>> by_type;
  for (const auto& p : module.parameters(true)) by_type[p.scalar_type()].push_back(p);
  for (const auto& b : module.buffers(true)) by_type[b.scalar_type()].push_back(b);
  for (auto& [type, tensors] : by_type) {
    std::vector<at::Tensor> flat_parts;
    for (auto& t : tensors) flat_parts.push_back(t.reshape({-1}));
    auto flat = torch::cat(flat_parts);
    comm.broadcast(flat, 0);
    int64_t off = 0;
    for (auto& t : tensors) {
      t.copy_(flat.narrow(0, off, t.numel()).view_as(t));
      off += t.numel();
    }
  }
}

std::string share_from_rank0(Communicator& comm, const c10::Device& device, const std::string& value) {
  // Length, then bytes.
  auto len = torch::tensor({static_cast<int64_t>(value.size())}, torch::kLong).to(device);
  comm.broadcast(len, 0);
  if (len.item<int64_t>() == 0) return std::string();
  auto bytes = torch::zeros({len.item<int64_t>()}, torch::kUInt8);
  if (comm.rank() == 0) std::memcpy(bytes.data_ptr(), value.data(), value.size());
  bytes = bytes.to(device);
  comm.broadcast(bytes, 0);
  bytes = bytes.cpu();
  return std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()));
}

double mean_over_ranks(Communicator& comm, const c10::Device& device, double local_value) {
  auto t = torch::tensor({local_value}, torch::kDouble).to(device);
  comm.all_reduce(t, ReduceOp::kAvg);
  return t.item<double>();
}

double sum_over_ranks(Communicator& comm, const c10::Device& device, double local_value) {
  auto t = torch::tensor({local_value}, torch::kDouble).to(device);
  comm.all_reduce(t, ReduceOp::kSum);
  return t.item<double>();
}

}  // namespace polytrain
