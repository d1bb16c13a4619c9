// A user's own trainer: subclass Trainer, override forward_step, train 5 steps. With
// `self_launch PORT` after the experiments folder it asks for pytorchDDP on 2 processes, as a
// FlagAI user does in the Trainer's arguments, and starts itself under `launch`.
#include <cstdio>
#include <string>

#include <torch/torch.h>

#include <polytrain/common/config.h>
#include <polytrain/models/bert.h>
#include <polytrain/trainer/trainer.h>

class RandomTokens : public polytrain::BatchSource {
 public:
  int64_t size() const override { return 64; }
  polytrain::Batch make_batch(const std::vector<int64_t>& indices, int64_t epoch) const override {
    const int64_t b = static_cast<int64_t>(indices.size());
    auto gen = torch::arange(b * 16, torch::kLong).view({b, 16});
    auto ids = (gen * 7 + indices[0]) % 60 + 4;
    polytrain::Batch batch;
    batch.set("input_ids", ids);
    batch.set("attention_mask", torch::ones_like(ids));
    batch.set("token_type_ids", torch::zeros_like(ids));
    batch.set("labels", ids.clone());
    return batch;
  }
};

class MyTrainer : public polytrain::Trainer {
 public:
  using Trainer::Trainer;
  polytrain::ModelOutput forward_step(const polytrain::Batch& batch, torch::nn::Module& model) override {
    auto& bert = dynamic_cast<polytrain::BertForMaskedLMImpl&>(model);
    return bert.forward(batch.at("input_ids"), batch.at("attention_mask"), batch.at("token_type_ids"),
                        batch.at("labels"));
  }
};

int main(int argc, char** argv) {
  polytrain::Config cfg;
  cfg.batch = {8, 8, 1, 1};
  cfg.model.vocab_size = 64;
  cfg.model.hidden_size = 32;
  cfg.model.num_hidden_layers = 1;
  cfg.model.num_attention_heads = 2;
  cfg.model.intermediate_size = 64;
  cfg.trainer.max_steps = 5;
  cfg.trainer.log_interval = 1;
  cfg.trainer.eval_interval = 0;
  cfg.trainer.progress_bar = false;
  cfg.trainer.experiments_dir = argc > 1 ? argv[1] : "experiments";
  if (argc > 3 && std::string(argv[2]) == "self_launch") {
    cfg.trainer.env_type = "pytorchDDP";
    cfg.trainer.num_gpus = 2;
    cfg.trainer.master_port = std::stoi(argv[3]);
    cfg.batch = {16, 8, 1, 2};
  }
  MyTrainer trainer(cfg);
  polytrain::BertForMaskedLM model(cfg.model);
  RandomTokens data;
  auto result = trainer.train(model.ptr(), data);
  std::printf("outside project trained %lld steps\n", static_cast<long long>(result.steps));
  return result.steps == 5 && result.losses.size() == 5 ? 0 : 1;
}
