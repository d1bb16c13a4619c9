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
  for (const auto& [name, t] : tensors) out.tensors[name] = t.to(device);
  return out;
}

}  // namespace polytrain
