// run_pipeline_plan: the one-stage pipeline (every layer in order in this process), and the
// carry helpers the models' plans use.
#include "polytrain/models/pipeline_plan.h"

#include "polytrain/common/error.h"

namespace polytrain {

at::Tensor run_pipeline_plan(const PipelinePlan& plan, const TensorMap& inputs) {
  PT_CHECK(!plan.layers.empty(), "run_pipeline_plan: the plan has no layers");
  TensorMap carry;
  for (const auto& layer : plan.layers) {
    PT_CHECK(layer.run, "run_pipeline_plan: layer '", layer.name, "' has no run function");
    layer.run(inputs, carry);
  }
  auto it = carry.find("loss");
  PT_CHECK(it != carry.end() && it->second.defined(), "run_pipeline_plan: the last layer ('", plan.layers.back().name,
           "') left no \"loss\" in the carry (were labels given?)");
  return it->second;
}

const at::Tensor& plan_input(const TensorMap& inputs, const std::string& name, const std::string& layer) {
  auto it = inputs.find(name);
  PT_INPUT_CHECK(it != inputs.end() && it->second.defined(), "pipeline layer '", layer, "' needs the input '", name,
                 "', which the micro-batch does not have");
  return it->second;
}

at::Tensor plan_optional(const TensorMap& m, const std::string& name) {
  auto it = m.find(name);
  return it == m.end() ? at::Tensor() : it->second;
}

void plan_put(TensorMap& m, const std::string& name, const at::Tensor& t) {
  if (t.defined())
    m[name] = t;
  else
    m.erase(name);
}

PipeLayer embeddings_layer(
    std::string type, std::vector<std::string> params,
    std::function<std::pair<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&)> embed) {
  return {"embeddings", std::move(type), std::move(params), [embed](const TensorMap& in, TensorMap& carry) {
            auto [hidden, mask] = embed(plan_input(in, "input_ids", "embeddings"), plan_optional(in, "attention_mask"),
                                        plan_optional(in, "token_type_ids"));
            carry["hidden"] = hidden;
            plan_put(carry, "mask", mask);
          }};
}

PipeLayer block_layer(std::string name, std::string type, std::vector<std::string> params,
                      std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> block) {
  return {std::move(name), std::move(type), std::move(params), [block](const TensorMap&, TensorMap& carry) {
            carry["hidden"] = block(carry.at("hidden"), plan_optional(carry, "mask"));
          }};
}

PipeLayer loss_head(std::string type, std::vector<std::string> params,
                    std::function<at::Tensor(const at::Tensor& hidden, const TensorMap& inputs)> loss) {
  return {"head", std::move(type), std::move(params), [loss](const TensorMap& in, TensorMap& carry) {
            const at::Tensor hidden = carry.at("hidden");
            carry.clear();  // the last layer: what the others carried ends here
            carry["loss"] = loss(hidden, in);
          }};
}

}  // namespace polytrain
