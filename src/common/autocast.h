// Mixed precision for the forward pass: torch autocast on the model's device with fp16 or
// bf16 (the weights stay fp32: they are the master weights the optimizer updates).
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <optional>

namespace polytrain {

/// The autocast type active for `device` now (nullopt when autocast is off).
std::optional<c10::ScalarType> autocast_type(c10::DeviceType device);

/// Enables autocast for `device` with `dtype` for its lifetime (nestable); restores the previous
/// settings and clears the cast-weight cache when the outermost guard ends.
class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device, c10::ScalarType dtype);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  c10::DeviceType device_;
  bool prev_enabled_;
  c10::ScalarType prev_dtype_;
};

}  // namespace polytrain
