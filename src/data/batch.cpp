#include "polytrain/data/batch.h"

#include "polytrain/common/error.h"

namespace polytrain {

const at::Tensor& Batch::at(const std::string& name) const {
  auto it = tensors.find(name);
  PT_CHECK(it != tensors.end(), "batch has no tensor '", name, "'");
  return it->second;
}

int64_t Batch::size() const {
  if (tensors.empty()) return 0;
  const auto& t = tensors.begin()->second;
  return t.dim() == 0 ? 1 : t.size(0);
}

Batch Batch::to(c10::Device device) const {
  Batch out;
  // To a GPU: from page-locked memory, asynchronously (the copy is queued on the current
  // stream behind the work before it; the host does not wait for it).
  const bool async = device.is_cuda();
  for (const auto& [name, t] : tensors)
    out.tensors[name] = async && t.device().is_cpu() ? t.pin_memory().to(device, /*non_blocking=*/true) : t.to(device);
  return out;
}

}  // namespace polytrain
