// The training step of bench_gpu_step and bench_gpu_profile (issue 15): GPT-2 124M, BERT-base
// or T5-small (or their -tiny versions) on random tokens, dropout off, as polytrain's pytorch
// backend steps it (the model, apply_update's norm + clip at 1.0, make_optimizer's AdamW,
// gradients set to none), with the switches of bench_gpu_step's usage.
#pragma once

#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

#ifdef POLYTRAIN_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "polytrain/common/autocast.h"
#include "polytrain/common/config.h"
#include "polytrain/models/bert.h"
#include "polytrain/models/gpt2.h"
#include "polytrain/models/t5.h"
#include "polytrain/parallel/update.h"
#include "polytrain/optim/optimizers.h"

namespace polytrain::bench {

constexpr double kPeakBf16 = 989.4e12;  // H100 SXM dense bf16 (datasheet; H200: the same)

inline std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string t; std::getline(in, t, ',');)
    if (!t.empty()) out.push_back(t);
  return out;
}

inline void device_sync(const c10::Device& d) {
#ifdef POLYTRAIN_WITH_CUDA
  if (d.is_cuda()) c10::cuda::device_synchronize();
#endif
  (void)d;
}

struct GpuStep {
  c10::Device device{c10::kCPU};
  std::set<std::string> sw;
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(int64_t)> make_loss;  ///< batch -> loss (data made once per batch size)
  std::function<double(int64_t)> flops;           ///< batch -> model FLOPs per step
  int64_t tokens_per_sample = 0;
  int64_t n_params = 0;
  std::vector<at::Tensor> params;
  std::unique_ptr<Optimizer> opt;
  UpdateOptions uo;

  at::Tensor forward(int64_t b) {
    std::optional<AutocastGuard> ac;
    if (sw.count("bf16")) ac.emplace(device.type(), c10::kBFloat16);
    return make_loss(b);
  }
  void clear() {
    for (auto& p : params) p.mutable_grad() = at::Tensor();  // set_to_none, torch's default
  }
  void step(int64_t b) {
    auto loss = forward(b);
    loss.backward();
    apply_update(params, *opt, uo, {}, nullptr);
    clear();
  }
  /// The first micro-batch of `batches` (largest first) whose step fits; 0 when none does.
  int64_t fit(const std::vector<std::string>& batches) {
    for (const auto& text : batches) {
      const int64_t b = std::stoll(text);
      try {
        step(b);
        device_sync(device);
        return b;
      } catch (const c10::Error& e) {
        if (std::string(e.what()).find("out of memory") == std::string::npos) throw;
        std::printf("oom_at_batch %lld\n", static_cast<long long>(b));
        clear();
#ifdef POLYTRAIN_WITH_CUDA
        c10::cuda::CUDACachingAllocator::emptyCache();
#endif
      }
    }
    return 0;
  }
};

/// switches: "fast" = bf16,sdpa,tf32,fused; "exact" = none; or a comma list of bf16, sdpa,
/// tf32, fused, foreach, dense.
inline GpuStep make_gpu_step(const std::string& model_name, const std::string& switches, int64_t seq, int64_t dec_seq) {
  GpuStep s;
  if (switches == "fast")
    s.sw = {"bf16", "sdpa", "tf32", "fused"};
  else if (switches != "exact")
    for (auto& w : split_list(switches)) s.sw.insert(w);
  const bool tiny = model_name.size() > 5 && model_name.substr(model_name.size() - 5) == "-tiny";
  const std::string kind = tiny ? model_name.substr(0, model_name.size() - 5) : model_name;
  s.device = torch::cuda::is_available() ? c10::Device("cuda:0") : c10::Device("cpu");
  if (s.device.is_cuda()) at::globalContext().setFloat32MatmulPrecision(s.sw.count("tf32") ? "high" : "highest");
  const std::string attn = s.sw.count("sdpa") ? "sdpa" : "eager";
  torch::manual_seed(0);

  // The model, its loss on a batch, and its model FLOPs per step (matmuls forward + backward:
  // 6 x matmul parameters x tokens they apply to, + attention 12 x layers x width x Lq x Lk).
  s.tokens_per_sample = seq;
  const auto device = s.device;
  const auto& sw = s.sw;
  if (kind == "gpt2") {
    Gpt2Config c;
    if (tiny) c.n_embd = 64, c.n_layer = 2, c.n_head = 2, c.vocab_size = 1000;
    c.n_positions = std::max<int64_t>(c.n_positions, seq);
    c.resid_pdrop = c.embd_pdrop = c.attn_pdrop = 0.0;
    c.attn_implementation = attn;
    auto m = Gpt2LMHeadModel(c);
    s.module = m.ptr();
    const double d = c.n_embd, blocks = c.n_layer * 12 * d * d;  // QKV + proj + 2 x MLP (4d)
    s.flops = [=](int64_t b) {
      const double t = static_cast<double>(b * seq);
      return 6 * (blocks + d * c.vocab_size) * t + 12 * c.n_layer * d * seq * t;
    };
    std::shared_ptr<at::Tensor> ids = std::make_shared<at::Tensor>();
    s.make_loss = [=](int64_t b) mutable {
      if (!ids->defined() || ids->size(0) != b) *ids = torch::randint(0, c.vocab_size, {b, seq}, torch::kLong).to(device);
      return m->forward(*ids, {}, *ids).loss;
    };
  } else if (kind == "bert") {
    ModelConfig mc;  // bert-base-uncased
    if (tiny) mc.hidden_size = 64, mc.num_hidden_layers = 2, mc.num_attention_heads = 2, mc.intermediate_size = 256;
    mc.max_position_embeddings = std::max<int64_t>(mc.max_position_embeddings, seq);
    mc.hidden_dropout_prob = mc.attention_probs_dropout_prob = 0.0;
    mc.attn_implementation = attn;
    auto m = BertForMaskedLM(mc);
    if (sw.count("dense")) m->score_masked_only_ = false;
    s.module = m.ptr();
    const double h = mc.hidden_size, I = mc.intermediate_size, V = mc.vocab_size;
    const bool dense = sw.count("dense") > 0;
    s.flops = [=](int64_t b) {  // the head counted at the labelled 15% (the work the loss needs)
      const double t = static_cast<double>(b * seq), scored = dense ? t : 0.15 * t;
      return 6 * mc.num_hidden_layers * (4 * h * h + 2 * h * I) * t + 12 * mc.num_hidden_layers * h * seq * t +
             6 * (h * h + h * V) * scored;
    };
    auto data = std::make_shared<std::vector<at::Tensor>>();
    s.make_loss = [=](int64_t b) mutable {
      if (data->empty() || (*data)[0].size(0) != b) {
        torch::manual_seed(1);
        auto ids = torch::randint(1000, mc.vocab_size, {b, seq}, torch::kLong);
        auto labels = torch::where(torch::rand({b, seq}) < 0.15, ids, torch::full_like(ids, -100));
        *data = {ids.to(device), labels.to(device), torch::zeros_like(ids).to(device)};
      }
      return m->forward((*data)[0], {}, (*data)[2], (*data)[1]).loss;
    };
  } else if (kind == "t5") {
    T5Config c;  // t5-small
    if (tiny) c.d_model = 64, c.d_kv = 32, c.d_ff = 128, c.num_layers = 2, c.num_heads = 2, c.vocab_size = 1000;
    c.dropout_rate = 0.0;
    c.attn_implementation = attn;
    auto m = T5ForConditionalGeneration(c);
    s.module = m.ptr();
    s.tokens_per_sample = seq + dec_seq;
    const double dm = c.d_model, inner = c.num_heads * c.d_kv, ff = c.d_ff;
    s.flops = [=](int64_t b) {
      const double enc = 2 * dm * inner + dm * inner * 2 + 2 * dm * ff;   // q,k,v,o + wi, wo
      const double dec = enc + 4 * dm * inner;                               // + cross-attention
      const double te = static_cast<double>(b * seq), td = static_cast<double>(b * dec_seq);
      const double L = c.num_layers;
      return 6 * (L * enc * te + L * dec * td + dm * c.vocab_size * td) +
             12 * L * inner * (te * seq + td * dec_seq + td * seq);
    };
    auto data = std::make_shared<std::vector<at::Tensor>>();
    s.make_loss = [=](int64_t b) mutable {
      if (data->empty() || (*data)[0].size(0) != b) {
        torch::manual_seed(1);
        *data = {torch::randint(2, c.vocab_size, {b, seq}, torch::kLong).to(device),
                 torch::randint(2, c.vocab_size, {b, dec_seq}, torch::kLong).to(device)};
      }
      return m->forward((*data)[0], {}, (*data)[1]).loss;
    };
  } else {
    throw std::invalid_argument("unknown model " + model_name);
  }
  s.module->to(s.device);
  s.module->train();
  OptimizerConfig oc;
  oc.type = "AdamW";
  oc.lr = 1e-4;
  oc.weight_decay = 0.01;
  if (sw.count("fused")) oc.fused = true;
  else if (sw.count("foreach")) oc.foreach = true;
  else oc.fused = false;  // libtorch's per-parameter loop
  NamedParams named;
  for (auto& p : s.module->named_parameters()) {
    named.emplace_back(p.key(), p.value());
    s.params.push_back(p.value());
    s.n_params += p.value().numel();
  }
  s.opt = make_optimizer(oc, split_by_decay(oc, named));
  s.uo.lr = oc.lr;
  s.uo.clip = 1.0;
  return s;
}

}  // namespace polytrain::bench
