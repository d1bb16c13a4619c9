#include "polytrain/models/tied_embedding.h"

#include <atomic>
#include <mutex>
#include <set>
#include <unordered_set>

#include <torch/torch.h>

namespace polytrain::tied_embedding {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Registry {
  std::mutex mu;
  std::unordered_set<const c10::TensorImpl*> looked_up;  // weights looked up with grad, ever
  std::set<int64_t> given;  // lookups whose head gave a dense gradient, not yet backed up
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> sparse{0};
};

Registry& registry() {
  static Registry r;
  return r;
}

// Lookups whose backward never ran (a graph freed without a backward) leave their mark here
// only when a head marked them; the oldest go once there are many.
constexpr size_t kMaxGiven = 256;

struct Lookup : torch::autograd::Function<Lookup> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& weight, const at::Tensor& ids,
                            int64_t padding_idx, int64_t id) {
    ctx->save_for_backward({ids});
    ctx->saved_data["rows"] = weight.size(0);
    ctx->saved_data["pad"] = padding_idx;
    ctx->saved_data["id"] = id;
    return at::embedding(weight, ids, padding_idx);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto ids = ctx->get_saved_variables()[0];
    const int64_t rows = ctx->saved_data["rows"].toInt(), pad = ctx->saved_data["pad"].toInt();
    bool sparse = false;
    {
      auto& r = registry();
      std::lock_guard<std::mutex> lock(r.mu);
      sparse = r.given.erase(ctx->saved_data["id"].toInt()) > 0;
    }
    const auto& g = grad_out[0];
    variable_list out(4);
    if (!sparse) {
      out[0] = at::embedding_backward(g, ids, rows, pad, false, false);
      return out;
    }
    ++registry().sparse;
    const int64_t h = g.size(-1);
    auto values = g.reshape({-1, h});
    auto index = ids.reshape({1, -1});
    if (pad >= 0) values = values.masked_fill(index.squeeze(0).eq(pad).unsqueeze(1), 0);
    out[0] = at::_sparse_coo_tensor_unsafe(index, values.contiguous(), {rows, h}, g.options().layout(at::kSparse));
    return out;
  }
};

}  // namespace

at::Tensor lookup(const at::Tensor& weight, const at::Tensor& ids, int64_t padding_idx) {
  if (!weight.device().is_cpu() || !weight.requires_grad() || !at::GradMode::is_enabled())
    return at::embedding(weight, ids, padding_idx);
  auto& r = registry();
  const int64_t id = ++r.next;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    r.looked_up.insert(weight.unsafeGetTensorImpl());
  }
  return Lookup::apply(weight, ids, padding_idx, id);
}

std::vector<int64_t> lookups_below(const at::Tensor& hidden, const at::Tensor& weight) {
  std::vector<int64_t> ids;
  if (!hidden.grad_fn() || !weight.requires_grad()) return ids;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    if (!r.looked_up.count(weight.unsafeGetTensorImpl())) return ids;
  }
  const auto target = torch::autograd::impl::gradient_edge(weight);
  std::unordered_set<const torch::autograd::Node*> seen{hidden.grad_fn().get()};
  std::vector<torch::autograd::Node*> todo{hidden.grad_fn().get()};
  while (!todo.empty()) {
    auto* node = todo.back();
    todo.pop_back();
    if (auto* lookup = dynamic_cast<torch::autograd::CppNode<Lookup>*>(node)) {
      const auto& e = lookup->next_edge(0);
      if (e.function == target.function && e.input_nr == target.input_nr)
        ids.push_back(lookup->ctx_.saved_data["id"].toInt());
    }
    for (const auto& e : node->next_edges())
      if (e.function && seen.insert(e.function.get()).second) todo.push_back(e.function.get());
  }
  return ids;
}

void dense_gradient_given(const std::vector<int64_t>& ids) {
  if (ids.empty()) return;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.given.insert(ids.begin(), ids.end());
  while (r.given.size() > kMaxGiven) r.given.erase(r.given.begin());
}

int64_t sparse_gradients() { return registry().sparse.load(); }
}  // namespace polytrain::tied_embedding
