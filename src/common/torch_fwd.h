// Forward declarations of the torch C++ frontend classes that lean headers name by reference,
// so they need not include <torch/torch.h>.
#pragma once

namespace torch {
namespace nn {
class Module;
}
namespace optim {
class Optimizer;
}
namespace serialize {
class OutputArchive;
class InputArchive;
}  // namespace serialize
}  // namespace torch
