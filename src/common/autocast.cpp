// LibTorch renamed the autocast controls in 2.4 (per device type instead of cpu/gpu pairs).
#include "polytrain/common/autocast.h"

#include <ATen/autocast_mode.h>
#include <torch/version.h>

#include "polytrain/common/error.h"

namespace polytrain {

namespace {

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
bool enabled(c10::DeviceType d) { return at::autocast::is_autocast_enabled(d); }
void set_enabled(c10::DeviceType d, bool on) { at::autocast::set_autocast_enabled(d, on); }
c10::ScalarType dtype(c10::DeviceType d) { return at::autocast::get_autocast_dtype(d); }
void set_dtype(c10::DeviceType d, c10::ScalarType t) { at::autocast::set_autocast_dtype(d, t); }
#else
bool enabled(c10::DeviceType d) { return d == c10::kCUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled(); }
void set_enabled(c10::DeviceType d, bool on) {
  if (d == c10::kCUDA)
    at::autocast::set_enabled(on);
  else
    at::autocast::set_cpu_enabled(on);
}
c10::ScalarType dtype(c10::DeviceType d) {
  return d == c10::kCUDA ? at::autocast::get_autocast_gpu_dtype() : at::autocast::get_autocast_cpu_dtype();
}
void set_dtype(c10::DeviceType d, c10::ScalarType t) {
  if (d == c10::kCUDA)
    at::autocast::set_autocast_gpu_dtype(t);
  else
    at::autocast::set_autocast_cpu_dtype(t);
}
#endif

}  // namespace

std::optional<c10::ScalarType> autocast_type(c10::DeviceType device) {
  if (device != c10::kCUDA && device != c10::kCPU) return std::nullopt;
  if (!enabled(device)) return std::nullopt;
  return dtype(device);
}

AutocastGuard::AutocastGuard(c10::DeviceType device, c10::ScalarType dtype_)
    : device_(device), prev_enabled_(enabled(device)), prev_dtype_(dtype(device)) {
  PT_INPUT_CHECK(device == c10::kCUDA || device == c10::kCPU, "autocast: device type ", c10::DeviceTypeName(device),
                 " is not supported (cpu or cuda)");
  PT_INPUT_CHECK(device == c10::kCUDA || dtype_ == c10::kBFloat16,
                 "fp16 needs a CUDA device (trainer.pytorch_device cuda); on CPU use bf16");
  set_enabled(device, true);
  set_dtype(device, dtype_);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  set_enabled(device_, prev_enabled_);
  set_dtype(device_, prev_dtype_);
}

}  // namespace polytrain
