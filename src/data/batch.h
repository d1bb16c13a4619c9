// A batch as the Trainer hands it to forward_step: named tensors, as FlagAI passes **data.
// Collators build it; backends move it to the device. Nothing here knows about models.
#pragma once

#include <map>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace polytrain {

/// Named tensors of one micro-batch: input_ids, attention_mask, token_type_ids, labels, ...
struct Batch {
  std::map<std::string, at::Tensor> tensors;

  const at::Tensor& at(const std::string& name) const;
  bool has(const std::string& name) const { return tensors.count(name) > 0; }
  void set(const std::string& name, at::Tensor t) { tensors[name] = std::move(t); }
  /// Number of samples (first dimension of the first tensor; 0 when empty).
  int64_t size() const;
  /// A copy with every tensor on `device`.
  Batch to(c10::Device device) const;
};

}  // namespace polytrain
