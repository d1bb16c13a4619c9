// C++ side of bench/bert_step.sh: per-step time (forward + backward + clip + AdamW) of
// polytrain's BertForMaskedLM on a fixed random batch, the same model, batch and threads as
// bert_step_torch.py. Usage: bench_bert_step tiny|base STEPS THREADS [MODE]
// MODE: default (the trainer's default: fused LM loss, no [tokens, vocab] logits),
//       dense (logits materialised + cross_entropy: the same kernels as the Python side),
//       masked_only (fused loss and the head transform only at masked positions),
//       checkpoint (default + activation checkpointing of every encoder layer).
// Also prints the process's peak resident memory (getrusage), for bench/activation_memory.sh.
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <string>

#include <torch/torch.h>

#include "polytrain/common/config.h"
#include "polytrain/models/bert.h"
#include "polytrain/parallel/update.h"
#include "polytrain/trainer/optimizers.h"

using namespace polytrain;

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: bench_bert_step tiny|base STEPS THREADS [default|dense|masked_only|checkpoint]\n");
    return 2;
  }
  const std::string size = argv[1];
  const int steps = std::stoi(argv[2]);
  at::set_num_threads(std::stoi(argv[3]));
  const std::string mode = argc > 4 ? argv[4] : "default";
  torch::manual_seed(0);
  ModelConfig mc;
  int64_t batch = 32;
  if (size == "tiny") {
    mc.hidden_size = 128, mc.num_hidden_layers = 2, mc.num_attention_heads = 2, mc.intermediate_size = 512;
  } else {
    batch = 8;
  }
  BertForMaskedLM model(mc);
  model->score_masked_only_ = mode == "masked_only";
  model->fused_lm_loss_ = mode != "dense";
  model->set_activation_checkpointing(mode == "checkpoint");
  OptimizerConfig oc;
  oc.type = "AdamW";
  oc.lr = 1e-4;
  oc.weight_decay = 0.01;
  std::vector<std::pair<std::string, torch::Tensor>> named;
  std::vector<at::Tensor> params;
  for (auto& p : model->named_parameters()) named.emplace_back(p.key(), p.value()), params.push_back(p.value());
  auto opt = make_torch_optimizer(oc, named);
  auto ids = torch::randint(1000, mc.vocab_size, {batch, 128}, torch::kLong);
  auto labels = torch::where(torch::rand({batch, 128}) < 0.15, ids, torch::full_like(ids, -100));
  auto am = torch::ones_like(ids), tt = torch::zeros_like(ids);
  auto step = [&] {
    auto out = model->forward(ids, am, tt, labels);
    out.loss.backward();
    clip_grads(params, grad_norm(params), 1.0);
    opt->step();
    opt->zero_grad();
  };
  step();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) step();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / steps;
  std::printf("ms_per_step %s %.2f\n", size.c_str(), ms);
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  std::printf("peak_rss_mb %.1f\n", ru.ru_maxrss / 1024.0);
  return 0;
}
