// C++ side of bench/gpu_step.sh (issue 15): one training step (forward, backward, gradient
// norm + clip at 1.0, AdamW, gradients set to none) of GPT-2 124M, BERT-base or T5-small on
// random tokens, dropout off, as polytrain's pytorch backend runs it (models, apply_update,
// make_optimizer). gpu_step_torch.py runs the same models in Python PyTorch (eager and
// torch.compile).
//
// Usage: bench_gpu_step MODEL SWITCHES BATCHES SEQ STEPS [DEC_SEQ]
//   MODEL     gpt2 | bert | t5 (124M / base / small), or gpt2-tiny | bert-tiny | t5-tiny (CPU checks)
//   SWITCHES  "fast" = bf16,sdpa,tf32,fused; "exact" = none (fp32, eager attention, full-fp32
//             matmuls, libtorch's per-parameter AdamW); or a comma list of bf16, sdpa, tf32,
//             fused, foreach, dense (BERT: the LM head at every position, as HF computes it)
//   BATCHES   micro-batch sizes, largest first ("32,24,16"): the first that fits is timed
//   SEQ       tokens per sample (T5: encoder tokens); DEC_SEQ: T5's decoder tokens (default SEQ/4)
//   STEPS     timed steps, after 3 warm-up steps
// Prints "key value" lines: batch, ms_per_step, tokens_per_s, model_flops_per_step, mfu (of
// 989.4 TFLOP/s, the H100 SXM's dense bf16 peak), peak_mem_gb, syncs_per_step (CUDA's
// synchronizing calls counted by its sync-debug mode), and a per-phase split (forward,
// backward, update: from 3 extra steps with a device sync between phases).
#include <chrono>
#include <cstdio>
#include <functional>
#include <optional>
#include <set>
#include <sstream>
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
#include "polytrain/trainer/optimizers.h"

using namespace polytrain;

namespace {

constexpr double kPeakBf16 = 989.4e12;  // H100 SXM dense bf16 (datasheet; H200: the same)

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string t; std::getline(in, t, ',');)
    if (!t.empty()) out.push_back(t);
  return out;
}

void sync(const c10::Device& d) {
#ifdef POLYTRAIN_WITH_CUDA
  if (d.is_cuda()) c10::cuda::device_synchronize();
#endif
  (void)d;
}

#ifdef POLYTRAIN_WITH_CUDA
// Counts the warnings CUDA's sync-debug mode raises (one per synchronizing call).
struct SyncCounter : c10::WarningHandler {
  int64_t count = 0;
  void process(const c10::Warning& w) override {
    if (w.msg().find("synchroniz") != std::string::npos) ++count;
  }
};
#endif

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: bench_gpu_step gpt2|bert|t5[-tiny] fast|exact|SWITCHES BATCHES SEQ STEPS [DEC_SEQ]\n");
    return 2;
  }
  const std::string model_name = argv[1];
  std::set<std::string> sw;
  const std::string switches = argv[2];
  if (switches == "fast")
    sw = {"bf16", "sdpa", "tf32", "fused"};
  else if (switches != "exact")
    for (auto& s : split(switches)) sw.insert(s);
  const auto batches = split(argv[3]);
  const int64_t seq = std::stoll(argv[4]);
  const int steps = std::stoi(argv[5]);
  const int64_t dec_seq = argc > 6 ? std::stoll(argv[6]) : std::max<int64_t>(1, seq / 4);
  const bool tiny = model_name.size() > 5 && model_name.substr(model_name.size() - 5) == "-tiny";
  const std::string kind = tiny ? model_name.substr(0, model_name.size() - 5) : model_name;
  const c10::Device device = torch::cuda::is_available() ? c10::Device("cuda:0") : c10::Device("cpu");
  if (device.is_cuda()) at::globalContext().setFloat32MatmulPrecision(sw.count("tf32") ? "high" : "highest");
  const std::string attn = sw.count("sdpa") ? "sdpa" : "eager";
  torch::manual_seed(0);

  // The model, its loss on a batch, and its model FLOPs per step (matmuls forward + backward:
  // 6 x matmul parameters x tokens they apply to, + attention 12 x layers x width x Lq x Lk).
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(int64_t)> make_loss;  // batch -> loss (data made once per batch size)
  std::function<double(int64_t)> flops;           // batch -> model FLOPs per step
  int64_t tokens_per_sample = seq;
  if (kind == "gpt2") {
    Gpt2Config c;
    if (tiny) c.n_embd = 64, c.n_layer = 2, c.n_head = 2, c.vocab_size = 1000;
    c.n_positions = std::max<int64_t>(c.n_positions, seq);
    c.resid_pdrop = c.embd_pdrop = c.attn_pdrop = 0.0;
    c.attn_implementation = attn;
    auto m = Gpt2LMHeadModel(c);
    module = m.ptr();
    const double d = c.n_embd, blocks = c.n_layer * 12 * d * d;  // QKV + proj + 2 x MLP (4d)
    flops = [=](int64_t b) {
      const double t = static_cast<double>(b * seq);
      return 6 * (blocks + d * c.vocab_size) * t + 12 * c.n_layer * d * seq * t;
    };
    std::shared_ptr<at::Tensor> ids = std::make_shared<at::Tensor>();
    make_loss = [=](int64_t b) mutable {
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
    module = m.ptr();
    const double h = mc.hidden_size, I = mc.intermediate_size, V = mc.vocab_size;
    const bool dense = sw.count("dense") > 0;
    flops = [=](int64_t b) {  // the head counted at the labelled 15% (the work the loss needs)
      const double t = static_cast<double>(b * seq), scored = dense ? t : 0.15 * t;
      return 6 * mc.num_hidden_layers * (4 * h * h + 2 * h * I) * t + 12 * mc.num_hidden_layers * h * seq * t +
             6 * (h * h + h * V) * scored;
    };
    auto data = std::make_shared<std::vector<at::Tensor>>();
    make_loss = [=](int64_t b) mutable {
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
    module = m.ptr();
    tokens_per_sample = seq + dec_seq;
    const double dm = c.d_model, inner = c.num_heads * c.d_kv, ff = c.d_ff;
    flops = [=](int64_t b) {
      const double enc = 2 * dm * inner + dm * inner * 2 + 2 * dm * ff;   // q,k,v,o + wi, wo
      const double dec = enc + 4 * dm * inner;                               // + cross-attention
      const double te = static_cast<double>(b * seq), td = static_cast<double>(b * dec_seq);
      const double L = c.num_layers;
      return 6 * (L * enc * te + L * dec * td + dm * c.vocab_size * td) +
             12 * L * inner * (te * seq + td * dec_seq + td * seq);
    };
    auto data = std::make_shared<std::vector<at::Tensor>>();
    make_loss = [=](int64_t b) mutable {
      if (data->empty() || (*data)[0].size(0) != b) {
        torch::manual_seed(1);
        *data = {torch::randint(2, c.vocab_size, {b, seq}, torch::kLong).to(device),
                 torch::randint(2, c.vocab_size, {b, dec_seq}, torch::kLong).to(device)};
      }
      return m->forward((*data)[0], {}, (*data)[1]).loss;
    };
  } else {
    std::fprintf(stderr, "unknown model %s\n", model_name.c_str());
    return 2;
  }
  module->to(device);
  module->train();

  OptimizerConfig oc;
  oc.type = "AdamW";
  oc.lr = 1e-4;
  oc.weight_decay = 0.01;
  if (sw.count("fused")) oc.fused = true;
  else if (sw.count("foreach")) oc.foreach = true;
  else oc.fused = false;  // libtorch's per-parameter loop
  NamedParams named;
  std::vector<at::Tensor> params;
  int64_t n_params = 0;
  for (auto& p : module->named_parameters()) {
    named.emplace_back(p.key(), p.value());
    params.push_back(p.value());
    n_params += p.value().numel();
  }
  auto opt = make_optimizer(oc, split_by_decay(oc, named));
  UpdateOptions uo;
  uo.lr = oc.lr;
  uo.clip = 1.0;
  const bool bf16 = sw.count("bf16") > 0;
  auto forward = [&](int64_t b) {
    std::optional<AutocastGuard> ac;
    if (bf16) ac.emplace(device.type(), c10::kBFloat16);
    return make_loss(b);
  };
  auto clear = [&] {
    for (auto& p : params) p.mutable_grad() = at::Tensor();  // set_to_none, torch's default
  };
  auto step = [&](int64_t b) {
    auto loss = forward(b);
    loss.backward();
    apply_update(params, *opt, uo, {}, nullptr);
    clear();
  };

  // The largest micro-batch that fits.
  int64_t batch = 0;
  for (const auto& s : batches) {
    const int64_t b = std::stoll(s);
    try {
      step(b);
      sync(device);
      batch = b;
      break;
    } catch (const c10::Error& e) {
      if (std::string(e.what()).find("out of memory") == std::string::npos) throw;
      std::printf("oom_at_batch %lld\n", static_cast<long long>(b));
      clear();
#ifdef POLYTRAIN_WITH_CUDA
      c10::cuda::CUDACachingAllocator::emptyCache();
#endif
    }
  }
  if (batch == 0) {
    std::printf("no_batch_fits 1\n");
    return 1;
  }
  for (int i = 0; i < 2; ++i) step(batch);
#ifdef POLYTRAIN_WITH_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(0);
#endif
  sync(device);
  auto t0 = std::chrono::steady_clock::now();
  double loss_sum = 0;
  for (int i = 0; i < steps; ++i) step(batch);
  sync(device);
  const double ms = ms_since(t0) / steps;

  // Phases, with a device sync after each (3 steps).
  double f_ms = 0, b_ms = 0, u_ms = 0;
  for (int i = 0; i < 3; ++i) {
    auto t = std::chrono::steady_clock::now();
    auto loss = forward(batch);
    sync(device);
    f_ms += ms_since(t), t = std::chrono::steady_clock::now();
    loss.backward();
    sync(device);
    b_ms += ms_since(t), t = std::chrono::steady_clock::now();
    apply_update(params, *opt, uo, {}, nullptr);
    clear();
    sync(device);
    u_ms += ms_since(t);
    loss_sum += loss.item<double>();
  }
  // Synchronizing calls in 2 steps.
  double syncs = -1;
#ifdef POLYTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    SyncCounter counter;
    auto* previous = c10::WarningUtils::get_warning_handler();
    c10::WarningUtils::set_warning_handler(&counter);
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
    for (int i = 0; i < 2; ++i) step(batch);
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    c10::WarningUtils::set_warning_handler(previous);
    syncs = counter.count / 2.0;
  }
#endif
  const double tokens = static_cast<double>(batch * tokens_per_sample);
  std::printf("model %s\nswitches %s\ndevice %s\nparams %lld\nbatch %lld\nseq %lld\n", model_name.c_str(),
              switches.c_str(), device.str().c_str(), static_cast<long long>(n_params), static_cast<long long>(batch),
              static_cast<long long>(seq));
  std::printf("ms_per_step %.2f\ntokens_per_s %.0f\n", ms, 1000.0 * tokens / ms);
  std::printf("model_flops_per_step %.4e\nmfu %.4f\n", flops(batch), flops(batch) / (ms / 1000.0) / kPeakBf16);
  std::printf("forward_ms %.2f\nbackward_ms %.2f\nupdate_ms %.2f\n", f_ms / 3, b_ms / 3, u_ms / 3);
  std::printf("syncs_per_step %.1f\n", syncs);
  std::printf("loss %.4f\n", loss_sum / 3);
#ifdef POLYTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
    std::printf("peak_mem_gb %.2f\n", stats.allocated_bytes[0].peak / 1e9);  // [0]: the aggregate over pools
  }
#endif
  return 0;
}
