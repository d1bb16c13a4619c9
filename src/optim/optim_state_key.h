// The key of a parameter's state in torch::optim::Optimizer::state(): its TensorImpl address,
// as a string in libtorch 1.x (what c10::guts::to_string printed), as a void* in 2.x. Shared by
// Lamb and the by-name state (de)serialisation of the Optimizer adapters.
#pragma once

#include <sstream>
#include <string>
#include <type_traits>

#include <ATen/core/Tensor.h>

namespace polytrain {

template <typename Key>
Key optimizer_state_key(const at::Tensor& p) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream s;
    s << p.unsafeGetTensorImpl();
    return s.str();
  } else {
    return p.unsafeGetTensorImpl();
  }
}

}  // namespace polytrain
