// A model's forward as a sequence of layers, for pipeline parallelism (DeepSpeed's
// PipelineModule of LayerSpecs, Megatron's pre_process / post_process split), the way a TP plan
// (tp_layers.h) describes a model's split: the model says what its layers are and which
// parameters each one reads; the pipeline backend (parallel/pipeline) decides which stage runs
// which layers and moves the activations. No communication here.
//
// A layer reads the micro-batch's inputs (the named tensors forward_step feeds the model:
// input_ids, attention_mask, labels, token_type_ids, ...; every stage reads the same micro-batch)
// and a carry: the named tensors that flow from one layer to the next (hidden states, a mask, a
// position bias, an encoder output). Between stages the carry travels whole; floating tensors that
// require a gradient get one back. The last layer puts the micro-batch's loss, as the model's
// forward returns it, in the carry under "loss".
//
// Running every layer in order in one process is the model's forward: the same modules, the same
// operations, so the loss and gradients equal forward()'s.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace polytrain {

using TensorMap = std::map<std::string, at::Tensor>;

struct PipeLayer {
  std::string name;  ///< "embeddings", "h.3", "head": for messages and partition listings
  std::string type;  ///< the layer's class name ("Gpt2Block"): what `partition: type:REGEX` matches
  /// Name prefixes of the parameters the layer reads ("transformer.h.3.", "transformer.wte.weight").
  /// A parameter that several layers read on different stages (tied embeddings, ALBERT's shared
  /// layer) is kept on each of them; its gradients are summed over those stages.
  std::vector<std::string> params;
  /// The layer's forward: reads `inputs` and `carry`, leaves its outputs in `carry` (removing
  /// what later layers no longer need).
  std::function<void(const TensorMap& inputs, TensorMap& carry)> run;
};

struct PipelinePlan {
  std::vector<PipeLayer> layers;
};

/// Models that can be split into pipeline stages implement this.
class PipelinePlanned {
 public:
  virtual ~PipelinePlanned() = default;
  virtual PipelinePlan pipeline_plan() = 0;
};

/// Runs every layer of `plan` in order on one micro-batch and returns the carry's "loss"
/// (the model's forward loss): what a one-stage pipeline does.
at::Tensor run_pipeline_plan(const PipelinePlan& plan, const TensorMap& inputs);

// Helpers for the models' layers. The carry holds no undefined tensors (a backend moving it
// between stages need not know about them): an optional tensor is absent instead.

/// inputs[name]; an InputError naming the layer when the micro-batch lacks it.
const at::Tensor& plan_input(const TensorMap& inputs, const std::string& name, const std::string& layer);
/// m[name], or an undefined tensor when absent (an optional input, an absent padding mask).
at::Tensor plan_optional(const TensorMap& m, const std::string& name);
/// m[name] = t when t is defined; otherwise name is removed.
void plan_put(TensorMap& m, const std::string& name, const at::Tensor& t);

// Models whose blocks read the hidden states and one attention mask (GPT-2, BERT, ALBERT): the
// carry's "hidden" and "mask".
/// The first layer, named "embeddings": embed(input_ids, attention_mask, token_type_ids; the
/// last two may be undefined) -> the carry's "hidden" and "mask" (absent when undefined).
PipeLayer embeddings_layer(
    std::string type, std::vector<std::string> params,
    std::function<std::pair<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&)> embed);
/// A block: hidden = block(hidden, mask).
PipeLayer block_layer(std::string name, std::string type, std::vector<std::string> params,
                      std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> block);
/// A model's last layer, named "head": the carry becomes {"loss": loss(the carry's "hidden", inputs)}.
PipeLayer loss_head(std::string type, std::vector<std::string> params,
                    std::function<at::Tensor(const at::Tensor& hidden, const TensorMap& inputs)> loss);

}  // namespace polytrain
