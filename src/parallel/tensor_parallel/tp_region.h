// Megatron-LM's tensor-parallel communication operators (mpu/mappings.py; picotron's
// tp_communications.py) as libtorch autograd functions over a Communicator, and the
// vocab-parallel cross entropy (mpu/cross_entropy.py): the TensorParallelRegion the layers of
// models/tp_layers.h call.
#pragma once

#include <memory>

#include "polytrain/models/tp_layers.h"

namespace polytrain {

class Communicator;

/// The region over `group` (the tensor-parallel communicator; not owned, must outlive the
/// region). Tensors are made contiguous before each collective.
std::shared_ptr<TensorParallelRegion> make_tp_region(Communicator& group);

}  // namespace polytrain
