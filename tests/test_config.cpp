// Config parsing (common/config.h) and its CLI side (common/cli_config.h): DeepSpeed's batch
// rules, strict JSON (duplicates, line numbers), unknown keys with suggestions, type and range
// errors, ignored DeepSpeed keys, the HF model section, round trip, and CLI overrides.
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "polytrain/common/cli_config.h"
#include "polytrain/common/config.h"
#include "polytrain/common/error.h"

namespace polytrain {
namespace {

using nlohmann::json;

std::string error_of(const json& doc, int64_t world_size = 1) {
  try {
    config_from_json(doc, "config.json", world_size);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

json with_batch(json doc) {
  if (!doc.contains("train_batch_size") && !doc.contains("train_micro_batch_size_per_gpu"))
    doc["train_batch_size"] = 8;
  return doc;
}

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    value ? setenv(name, value, 1) : unsetenv(name);
  }
  ~ScopedEnv() { had_ ? setenv(name_, old_.c_str(), 1) : unsetenv(name_); }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

class TempFile {
 public:
  explicit TempFile(const std::string& text)
      : path_((std::filesystem::temp_directory_path() /
               ("polytrain_test_config_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++) +
                ".json"))
                  .string()) {
    std::ofstream(path_) << text;
  }
  ~TempFile() { std::filesystem::remove(path_); }
  const std::string& path() const { return path_; }

 private:
  static inline int counter_ = 0;
  std::string path_;
};

// ---- batch triple: DeepSpeed's _set_batch_related_parameters + _batch_assertion -------------

struct BatchCase {
  json given;        // any of the three keys
  int64_t world_size;
  int64_t train, micro, accum;  // expected when error is empty
  std::string error;            // substring of the InputError
};

TEST(ConfigBatch, DeepSpeedFillInRulesAndCheck) {
  const std::vector<BatchCase> cases = {
      // the issue's cases at world size 2
      {{{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", 16}, {"gradient_accumulation_steps", 1}}, 2, 32, 16, 1, ""},
      {{{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", 8}, {"gradient_accumulation_steps", 2}}, 2, 32, 8, 2, ""},
      {{{"train_batch_size", 33}, {"train_micro_batch_size_per_gpu", 17}, {"gradient_accumulation_steps", 2}}, 2, 0, 0, 0,
       "train_batch_size (33) != train_micro_batch_size_per_gpu (17) * gradient_accumulation_steps (2) * world_size (2) = 68"},
      {{{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", 18}, {"gradient_accumulation_steps", 1}}, 2, 0, 0, 0,
       "train_batch_size (32) != train_micro_batch_size_per_gpu (18)"},
      // two given: the third is derived
      {{{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", 8}}, 2, 32, 8, 2, ""},
      {{{"train_batch_size", 32}, {"gradient_accumulation_steps", 4}}, 2, 32, 4, 4, ""},
      {{{"train_micro_batch_size_per_gpu", 8}, {"gradient_accumulation_steps", 3}}, 2, 48, 8, 3, ""},
      // one given
      {{{"train_batch_size", 32}}, 2, 32, 16, 1, ""},
      {{{"train_micro_batch_size_per_gpu", 8}}, 2, 16, 8, 1, ""},
      {{{"train_batch_size", 8}, {"gradient_accumulation_steps", nullptr}}, 1, 8, 8, 1, ""},  // null = absent
      // derivations that do not divide
      {{{"train_batch_size", 33}}, 2, 0, 0, 0, "train_batch_size (33) is not divisible by world_size (2)"},
      {{{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", 6}}, 2, 0, 0, 0,
       "cannot derive gradient_accumulation_steps: train_batch_size (32) is not divisible by train_micro_batch_size_per_gpu (6) * world_size (2)"},
      {{{"train_batch_size", 32}, {"gradient_accumulation_steps", 3}}, 2, 0, 0, 0,
       "cannot derive train_micro_batch_size_per_gpu"},
      {{{"train_batch_size", 8}, {"train_micro_batch_size_per_gpu", 16}}, 1, 0, 0, 0, "not divisible"},
      // none, or only GA; non-positive values
      {json::object(), 2, 0, 0, 0, "give 'train_batch_size' or 'train_micro_batch_size_per_gpu'"},
      {{{"gradient_accumulation_steps", 2}}, 2, 0, 0, 0, "give 'train_batch_size' or"},
      {{{"train_batch_size", 0}}, 1, 0, 0, 0, "'train_batch_size' must be > 0, got 0"},
      {{{"train_batch_size", 8}, {"gradient_accumulation_steps", -1}}, 1, 0, 0, 0,
       "'gradient_accumulation_steps' must be > 0, got -1"},
      {{{"train_batch_size", "32"}}, 1, 0, 0, 0, "'train_batch_size' must be an integer or null, got string \"32\""},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.given.dump() + " at world size " + std::to_string(c.world_size));
    if (c.error.empty()) {
      const Config cfg = config_from_json(c.given, "config.json", c.world_size);
      EXPECT_EQ(cfg.batch.train_batch_size, c.train);
      EXPECT_EQ(cfg.batch.train_micro_batch_size_per_gpu, c.micro);
      EXPECT_EQ(cfg.batch.gradient_accumulation_steps, c.accum);
      EXPECT_EQ(cfg.batch.world_size, c.world_size);
    } else {
      const std::string err = error_of(c.given, c.world_size);
      EXPECT_NE(err.find(c.error), std::string::npos) << err;
      EXPECT_EQ(err.rfind("config.json: ", 0), 0u) << err;
    }
  }
}

TEST(ConfigBatch, WorldSizeFromEnvironment) {
  const json doc = {{"train_batch_size", 32}};
  {
    ScopedEnv env("WORLD_SIZE", "4");
    EXPECT_EQ(config_from_json(doc, "c").batch.train_micro_batch_size_per_gpu, 8);
    EXPECT_EQ(config_from_json(doc, "c", 2).batch.train_micro_batch_size_per_gpu, 16);  // argument wins
  }
  {
    ScopedEnv env("WORLD_SIZE", nullptr);
    EXPECT_EQ(config_from_json(doc, "c").batch.world_size, 1);
  }
  {
    ScopedEnv env("WORLD_SIZE", "two");
    EXPECT_THROW(config_from_json(doc, "c"), InputError);
  }
}

TEST(ConfigBatch, ResolveBatchAfterTheFact) {
  Config cfg = config_from_json({{"train_batch_size", 32}}, "c", 1);
  resolve_batch(cfg, {{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", 4}}, 4);
  EXPECT_EQ(cfg.batch.gradient_accumulation_steps, 2);
  EXPECT_EQ(cfg.batch.world_size, 4);
  EXPECT_THROW(resolve_batch(cfg, {{"train_batch_size", 30}}, 4), InputError);
}

// ---- strict JSON --------------------------------------------------------------------------

TEST(ConfigJson, DuplicateKeyNamesFilePathAndLine) {
  const std::string text =
      "{\n"
      "  \"train_batch_size\": 8,\n"
      "  \"optimizer\": {\"type\": \"Adam\",\n"
      "    \"params\": {\"lr\": 0.1,\n"
      "                \"lr\": 0.2}}\n"
      "}\n";
  try {
    parse_json_strict(text, "ds.json");
    FAIL() << "no error";
  } catch (const InputError& e) {
    EXPECT_STREQ(e.what(), "ds.json:5: duplicate key 'optimizer.params.lr'");
  }
  // inside an array, and after a comment that holds a quote
  const std::string in_array =
      "// \"x\" twice\n{\"a\": [{\"x\": 1}, {\"x\": 1,\n \"x\": 2}]}";
  try {
    parse_json_strict(in_array, "b.json");
    FAIL() << "no error";
  } catch (const InputError& e) {
    EXPECT_STREQ(e.what(), "b.json:3: duplicate key 'a[1].x'");
  }
  // the same key in different objects is fine
  EXPECT_NO_THROW(parse_json_strict(R"({"a": {"x": 1}, "b": {"x": 1}, "c": [{"x": 1}, {"x": 2}]})", "c"));
}

TEST(ConfigJson, ANumberOutOfRangeIsInputErrorNamingFileAndLine) {
  try {
    parse_json_strict("{\n  \"train_batch_size\": 8,\n  \"gradient_clipping\": 1e999\n}\n", "ds.json");
    FAIL() << "no error";
  } catch (const InputError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("ds.json:3:24: number overflow parsing '1e999'", 0), 0u) << e.what();
  }
}

TEST(ConfigJson, MalformedJsonGivesFileLineColumn) {
  const std::string text = "{\n  \"a\": 1,\n  \"b\": ,\n}\n";
  try {
    parse_json_strict(text, "bad.json");
    FAIL() << "no error";
  } catch (const InputError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("bad.json:3:8: ", 0), 0u) << msg;
    EXPECT_EQ(msg.find("json.exception"), std::string::npos) << msg;
  }
  try {
    parse_json_strict("", "empty.json");
    FAIL() << "no error";
  } catch (const InputError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("empty.json:1:1: ", 0), 0u) << e.what();
  }
  EXPECT_EQ(parse_json_strict("{\"a\": 1 /* c */} // end", "c")["a"], 1);  // comments, as hjson
}

TEST(ConfigJson, LoadConfigFromFile) {
  TempFile file(R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})");
  EXPECT_EQ(load_config(file.path(), 3).batch.train_batch_size, 24);
  try {
    load_config("/nonexistent/ds.json");
    FAIL() << "no error";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/ds.json"), std::string::npos);
  }
}

// ---- keys: unknown, typos, ignored DeepSpeed keys ----------------------------------------------

TEST(ConfigKeys, TypoIsAnErrorWithSuggestion) {
  EXPECT_EQ(error_of(with_batch({{"optimizer", {{"type", "AdamW"}, {"params", {{"weight_decy", 0.01}}}}}})),
            "config.json: unknown key 'optimizer.params.weight_decy' (did you mean 'weight_decay'?)");
  EXPECT_EQ(error_of(with_batch({{"gradient_clippin", 1.0}})),
            "config.json: unknown key 'gradient_clippin' (did you mean 'gradient_clipping'?)");
  EXPECT_EQ(error_of(with_batch({{"trainer", {{"epoch", 3}}}})),
            "config.json: unknown key 'trainer.epoch' (did you mean 'epochs'?)");
  EXPECT_EQ(error_of(with_batch({{"zero_optimization", {{"stage3_max_live_param", 10}}}})),
            "config.json: unknown key 'zero_optimization.stage3_max_live_param' (did you mean "
            "'stage3_max_live_parameters'?)");
  // no near name: the optimizer's accepted keys are listed instead
  const std::string err = error_of(with_batch({{"optimizer", {{"type", "SGD"}, {"params", {{"betas", {0.9, 0.99}}}}}}}));
  EXPECT_NE(err.find("unknown key 'optimizer.params.betas' (SGD takes: "), std::string::npos) << err;
  EXPECT_NE(err.find("momentum"), std::string::npos) << err;
  EXPECT_NE(error_of(with_batch({{"completely_unrelated", 1}})).find("unknown key 'completely_unrelated'"),
            std::string::npos);
}

TEST(ConfigKeys, MaxGradNormPointsToGradientClipping) {
  const std::string err =
      error_of(with_batch({{"optimizer", {{"type", "Adam"}, {"params", {{"max_grad_norm", 1.0}}}}}}));
  EXPECT_NE(err.find("'optimizer.params.max_grad_norm'"), std::string::npos) << err;
  EXPECT_NE(err.find("'gradient_clipping'"), std::string::npos) << err;
}

TEST(ConfigKeys, DeepSpeedKeysPolytrainDoesNotImplementAreListedAndWarnedOnce) {
  const json doc = with_batch({
      {"wandb", {{"enabled", true}, {"project", "p"}}},
      {"comms_logger", {{"enabled", false}}},  // disabled: nothing to warn about
      {"prescale_gradients", true},
      {"gradient_predivide_factor", 1.0},        // DeepSpeed's default: nothing to warn about
      {"flops_profiler", {{"enabled", true}, {"profile_step", 1}}},
      {"checkpoint", json::object()},
      {"zero_optimization", {{"stage", 2}, {"zero_quantized_weights", true}, {"load_from_fp32_weights", true}}},
      {"optimizer", {{"type", "Lamb"}, {"params", {{"max_coeff", 0.3}, {"min_coeff", 0.01}}}, {"legacy_fusion", true}}},
      {"bf16", {{"enabled", true}, {"immediate_grad_update", true}}},
      {"sparse_attention", {{"mode", "fixed"}}},
  });
  const Config cfg = config_from_json(doc, "config.json", 1);
  const std::vector<std::string> expected = {
      "prescale_gradients", "sparse_attention", "flops_profiler", "wandb", "optimizer.legacy_fusion",
      "optimizer.params.max_coeff", "zero_optimization.zero_quantized_weights", "bf16.immediate_grad_update"};
  EXPECT_EQ(cfg.ignored_keys, expected);
  testing::internal::CaptureStderr();
  warn_ignored_keys(cfg);
  const std::string out = testing::internal::GetCapturedStderr();
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
  EXPECT_EQ(out.rfind("warning: ", 0), 0u) << out;
  for (const auto& key : expected) EXPECT_NE(out.find(key), std::string::npos) << key;

  testing::internal::CaptureStderr();
  warn_ignored_keys(config_from_json(with_batch({}), "c", 1));
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
}

// Stage 3 reads two of its keys and does nothing with them (one optimizer step for all
// partitions, exports always gathered): named as ignored when given at stage 3, not at stage 2
// (where DeepSpeed reads none of them either), nor when absent; the coordinator's keys are used.
TEST(ConfigKeys, Stage3TuningKeysWithoutEffectAreListed) {
  const json z3 = {{"stage", 3},
                   {"stage3_prefetch_bucket_size", 1000},
                   {"stage3_max_live_parameters", 2000},
                   {"stage3_max_reuse_distance", 0},
                   {"sub_group_size", 3000},
                   {"stage3_gather_16bit_weights_on_model_save", true},
                   {"stage3_param_persistence_threshold", 10}};
  const Config cfg = config_from_json(with_batch({{"zero_optimization", z3}}), "config.json", 1);
  const std::vector<std::string> expected = {"zero_optimization.sub_group_size",
                                             "zero_optimization.stage3_gather_16bit_weights_on_model_save"};
  EXPECT_EQ(cfg.ignored_keys, expected);
  EXPECT_EQ(cfg.zero_optimization.stage3_param_persistence_threshold, 10);  // these are used
  EXPECT_EQ(cfg.zero_optimization.stage3_prefetch_bucket_size, 1000);
  EXPECT_EQ(cfg.zero_optimization.stage3_max_live_parameters, 2000);
  EXPECT_EQ(cfg.zero_optimization.stage3_max_reuse_distance, 0);
  json z2 = z3;
  z2["stage"] = 2;
  EXPECT_TRUE(config_from_json(with_batch({{"zero_optimization", z2}}), "config.json", 1).ignored_keys.empty());
  EXPECT_TRUE(config_from_json(with_batch({{"zero_optimization", {{"stage", 3}}}}), "config.json", 1).ignored_keys.empty());
}

// ---- values: types and ranges ---------------------------------------------------------------

struct BadCase {
  json doc;
  std::string error;
};

TEST(ConfigValues, InvalidConfigsNameTheKey) {
  const std::vector<BadCase> cases = {
      {{{"fp16", {{"enabled", "yes"}}}}, "'fp16.enabled' must be a boolean (true/false), got string \"yes\""},
      {{{"optimizer", {{"params", {{"lr", "1e-3"}}}}}}, "'optimizer.params.lr' must be a number, got string"},
      {{{"optimizer", {{"params", {{"lr", "auto"}}}}}}, "Hugging Face"},
      {{{"optimizer", {{"params", {{"lr", -1}}}}}}, "'optimizer.params.lr' must be >= 0, got -1"},
      {{{"optimizer", {{"params", {{"betas", {0.9}}}}}}}, "'optimizer.params.betas' must be a list of two numbers"},
      {{{"optimizer", {{"params", {{"betas", {0.9, 1.5}}}}}}}, "'optimizer.params.betas' must both be in [0, 1)"},
      {{{"optimizer", {{"type", "Adamm"}}}}, "'optimizer.type' must be one of Adam, AdamW, CPUAdam, Lamb, Adam8bit, AdamW8bit, LAMB8bit, SGD, Adagrad; got 'Adamm' (did you mean 'Adam'?)"},
      {{{"optimizer", {{"type", "Lion"}}}}, "DeepSpeed optimizer polytrain does not implement"},
      {{{"optimizer", {{"type", "SGD"}, {"params", {{"nesterov", true}}}}}}, "'optimizer.params.nesterov' needs momentum > 0"},
      {{{"optimizer", {{"type", "Lamb"}, {"params", {{"debias", true}, {"bias_correction", true}}}}}}, "give one"},
      {{{"optimizer", "Adam"}}, "'optimizer' must be an object, got string"},
      {{{"scheduler", {{"type", "WarmupDecayLR"}, {"params", {{"warmup_num_steps", 10}}}}}},
       "'scheduler.params.total_num_steps' is required for WarmupDecayLR"},
      {{{"scheduler", {{"type", "WarmupCosineLR"}, {"params", {{"total_num_steps", 0}}}}}},
       "'scheduler.params.total_num_steps' must be > 0, got 0"},
      {{{"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_type", "cosine"}}}}}},
       "'scheduler.params.warmup_type' must be one of log, linear; got 'cosine'"},
      {{{"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_num_steps", -5}}}}}}, "must be >= 0, got -5"},
      {{{"scheduler", {{"type", "WarmupLR"}, {"params", {{"total_num_steps", 5}}}}}},
       "unknown key 'scheduler.params.total_num_steps' (WarmupLR takes: "},
      {{{"scheduler", {{"type", "OneCycle"}, {"params", {{"cycle_min_lr", 0.1}}}}}},
       "'scheduler.params.cycle_max_lr' is required for OneCycle"},
      {{{"scheduler", {{"type", "warmuplr"}}}}, "(did you mean 'WarmupLR'?)"},
      {{{"scheduler", {{"params", {{"warmup_num_steps", 5}}}}}}, "'scheduler.type' is required"},
      {{{"scheduler", {{"type", "LRRangeTest"}, {"params", {{"lr_range_test_step_size", 0}}}}}}, "must be > 0"},
      {{{"fp16", {{"enabled", true}}}, {"bf16", {{"enabled", true}}}}, "'fp16.enabled' and 'bf16.enabled' are both true"},
      {{{"fp16", {{"enabled", true}}}, {"bfloat16", {{"enabled", true}}}}, "are both true"},
      {{{"bf16", {{"enabled", false}}}, {"bfloat16", {{"enabled", false}}}}, "'bf16' and 'bfloat16'"},
      {{{"fp16", {{"loss_scale_window", 0}}}}, "'fp16.loss_scale_window' must be > 0"},
      {{{"fp16", {{"hysteresis", 0}}}}, "'fp16.hysteresis' must be > 0"},
      {{{"fp16", {{"enabled", true}, {"fp16_master_weights_and_grads", true}}}}, "needs zero_optimization.stage 2"},
      {{{"gradient_clipping", -1.0}}, "'gradient_clipping' must be >= 0"},
      {{{"steps_per_print", 0}}, "'steps_per_print' must be > 0"},
      {{{"zero_optimization", {{"stage", 4}}}}, "'zero_optimization.stage' must be 0, 1, 2 or 3, got 4"},
      {{{"zero_optimization", {{"reduce_bucket_size", 0}}}}, "'zero_optimization.reduce_bucket_size' must be > 0"},
      {{{"zero_optimization", {{"allgather_bucket_size", 1.5}}}}, "must be an integer, got number 1.5"},
      {{{"zero_optimization", {{"offload_optimizer", {{"device", "gpu"}}}}}},
       "'zero_optimization.offload_optimizer.device' must be one of none, cpu, nvme; got 'gpu'"},
      {{{"zero_optimization", {{"offload_param", {{"device", "nvme"}}}}}}, "nvme_path' is required"},
      {{{"zero_optimization", {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}, {"ratio", 0.5}}}}}}, "needs stage 3"},
      {{{"zero_optimization", {{"offload_param", {{"ratio", 0.5}}}}}}, "unknown key 'zero_optimization.offload_param.ratio'"},
      {{{"zero_optimization", {{"cpu_offload", true}, {"offload_optimizer", {{"device", "cpu"}}}}}}, "give only one"},
      {{{"zero_optimization", {{"stage3_prefetch_bucket_size", 1}, {"prefetch_bucket_size", 2}}}}, "give one"},
      {{{"activation_checkpointing", {{"number_checkpoints", 0}}}}, "must be > 0"},
      {{{"tensorboard", {{"enabled", true}, {"output", "x"}}}}, "unknown key 'tensorboard.output' (did you mean 'output_path'?)"},
      {{{"model", {{"model_type", "gpt3"}}}}, "'model.model_type' must be one of bert, roberta, albert, gpt2, t5; got 'gpt3'"},
      {{{"model", {{"hidden_size", 770}}}}, "'model.hidden_size' (770) must be divisible by num_attention_heads (12)"},
      {{{"model", {{"hidden_dropout_prob", 1.0}}}}, "'model.hidden_dropout_prob' must be in [0, 1), got 1"},
      {{{"model", {{"num_hidden_layers", 0}}}}, "'model.num_hidden_layers' must be > 0"},
      {{{"model", {{"vocab_size", "big"}}}}, "'model.vocab_size' must be an integer"},
      {{{"data", {{"max_seq_length", 4}}}}, "'data.max_seq_length' must be >= 8, got 4"},
      {{{"data", {{"max_seq_length", 1024}}}}, "exceeds what model.max_position_embeddings (512) allows"},
      {{{"model", {{"model_type", "roberta"}}}, {"data", {{"max_seq_length", 512}}}}, "allows for roberta: 510"},
      {{{"data", {{"mask_prob", 1.5}}}}, "'data.mask_prob' must be in [0, 1]"},
      {{{"data", {{"random_replace_prob", 0.6}, {"unmask_replace_prob", 0.5}}}}, "must be <= 1"},
      {{{"data", {{"train_files", "a.txt"}}}}, "'data.train_files' must be a list of strings"},
      {{{"data", {{"train_files", {"a.txt", 3}}}}}, "'data.train_files[1]' must be a string"},
      {{{"data", {{"vocab", "v.txt"}}}}, "unknown key 'data.vocab' (did you mean 'vocab_file'?)"},
      {{{"trainer", {{"env_type", "ddp"}}}}, "'trainer.env_type' must be one of pytorch, pytorchDDP, deepspeed, deepspeed+mpu, hivemind"},
      {{{"trainer", {{"env_type", "pytorchddp"}}}}, "(did you mean 'pytorchDDP'?)"},
      {{{"trainer", {{"eval_interval", -1}}}}, "'trainer.eval_interval' must be >= 0, got -1"},
      {{{"trainer", {{"epochs", 0}}}}, "nothing to train"},
      {{{"trainer", {{"seed", -3}}}}, "'trainer.seed' must be a non-negative integer"},
      {{{"trainer", {{"pytorch_device", "gpu"}}}}, "must be cpu, cuda or cuda:N"},
      {{{"hivemind", {{"request_timeout", 20}}}}, "'hivemind.request_timeout' (20 s) must be shorter than hivemind.matchmaking_time (15 s)"},
      {{{"hivemind", {{"listen", "localhost"}}}}, "'hivemind.listen' must be HOST:PORT, got 'localhost'"},
      {{{"hivemind", {{"initial_peers", {"1.2.3.4:99999"}}}}}, "'hivemind.initial_peers' entries must be HOST:PORT"},
      {{{"hivemind", {{"metadata_expiration", 10}}}}, "must be >= 11 seconds"},
      {{{"hivemind", {{"compression", "zstd"}}}}, "'hivemind.compression' must be one of none, fp16, scaled_fp16, uint8, int4"},
      {{{"hivemind", {{"num_streams", 4}, {"stream_index", 4}}}}, "'hivemind.stream_index' must be in [0, num_streams = 4)"},
      {{{"hivemind", {{"target_bach_size", 4}}}}, "did you mean 'target_batch_size'?"},
      {{{"trainer", {{"env_type", "hivemind"}}}}, "hivemind.target_batch_size: env_type 'hivemind' needs"},
      {{{"trainer", {{"env_type", "hivemind"}}}, {"hivemind", {{"target_batch_size", 2}}}}, "smaller than this peer's micro-batch"},
      {json::array(), "the config must be a JSON object"},
  };
  for (const auto& c : cases) {
    const json doc = c.doc.is_object() ? with_batch(c.doc) : c.doc;
    const std::string err = error_of(doc);
    EXPECT_NE(err.find(c.error), std::string::npos) << c.doc.dump() << "\n  got: '" << err << "'";
  }
}

TEST(ConfigValues, OptimizerSemantics) {
  struct Case {
    json optimizer;
    std::string type;
    bool adam_w_mode;
  };
  for (const auto& c : std::vector<Case>{
           {json::object(), "AdamW", true},
           {{{"type", "adam"}}, "Adam", true},  // DeepSpeed: Adam = decoupled decay by default
           {{{"type", "ADAM"}, {"params", {{"adam_w_mode", false}}}}, "Adam", false},
           {{{"type", "AdamW"}, {"params", {{"adam_w_mode", false}}}}, "AdamW", true},  // the name wins
           {{{"type", "sgd"}}, "SGD", true},
       }) {
    const Config cfg = config_from_json(with_batch({{"optimizer", c.optimizer}}), "c", 1);
    EXPECT_EQ(cfg.optimizer.type, c.type) << c.optimizer;
    EXPECT_EQ(cfg.optimizer.adam_w_mode, c.adam_w_mode) << c.optimizer;
  }
  const Config lamb = config_from_json(
      with_batch({{"optimizer",
                   {{"type", "Lamb"},
                    {"params", {{"lr", 0.01}, {"betas", {0.8, 0.9}}, {"debias", false}, {"clamp_value", 5.0}}}}}}),
      "c", 1);
  EXPECT_DOUBLE_EQ(lamb.optimizer.lr, 0.01);
  EXPECT_DOUBLE_EQ(lamb.optimizer.beta1, 0.8);
  EXPECT_DOUBLE_EQ(lamb.optimizer.beta2, 0.9);
  EXPECT_FALSE(lamb.optimizer.bias_correction);
  EXPECT_DOUBLE_EQ(lamb.optimizer.clamp_value, 5.0);
  const Config adagrad = config_from_json(with_batch({{"optimizer", {{"type", "Adagrad"}}}}), "c", 1);
  EXPECT_DOUBLE_EQ(adagrad.optimizer.eps, 1e-10);  // torch.optim.Adagrad's default
  const Config torch_adam = config_from_json(
      with_batch({{"optimizer", {{"type", "Adam"}, {"params", {{"torch_adam", true}, {"weight_decay", 0.01}}}}}}), "c", 1);
  EXPECT_TRUE(torch_adam.ignored_keys.empty());
  EXPECT_DOUBLE_EQ(torch_adam.optimizer.weight_decay, 0.01);
}

TEST(ConfigValues, DeepSpeedDefaultsAndAliases) {
  const Config d = config_from_json(with_batch({}), "c", 1);
  EXPECT_EQ(d.scheduler.type, "");
  EXPECT_EQ(d.zero_optimization.stage, 0);
  EXPECT_FALSE(d.zero_optimization.overlap_comm);
  EXPECT_EQ(d.zero_optimization.offload_param.buffer_count, 5);
  EXPECT_EQ(d.zero_optimization.offload_optimizer.buffer_count, 4);
  EXPECT_FALSE(d.activation_checkpointing_present);
  EXPECT_EQ(d.steps_per_print, 10);
  EXPECT_EQ(d.tensorboard.job_name, "DeepSpeedJobName");

  const Config z = config_from_json(
      with_batch({{"zero_optimization",
                   {{"stage", 3},
                    {"reduce_bucket_size", 5e8},
                    {"prefetch_bucket_size", 1000},
                    {"stage3_gather_fp16_weights_on_model_save", true},
                    {"cpu_offload", true},
                    {"cpu_offload_param", true}}},
                  {"bfloat16", {{"enabled", true}}},
                  {"activation_checkpointing", json::object()},
                  {"scheduler", {{"type", "WarmupLR"}}}}),
      "c", 1);
  EXPECT_TRUE(z.zero_optimization.overlap_comm);  // DeepSpeed's default at stage 3
  EXPECT_EQ(z.zero_optimization.reduce_bucket_size, 500000000);
  EXPECT_EQ(z.zero_optimization.stage3_prefetch_bucket_size, 1000);
  EXPECT_TRUE(z.zero_optimization.stage3_gather_16bit_weights_on_model_save);
  EXPECT_EQ(z.zero_optimization.offload_optimizer.device, "cpu");
  EXPECT_EQ(z.zero_optimization.offload_param.device, "cpu");
  EXPECT_TRUE(z.bf16.enabled);
  EXPECT_TRUE(z.activation_checkpointing_present);
  EXPECT_EQ(z.scheduler.warmup_num_steps, 1000);
  EXPECT_EQ(z.scheduler.warmup_type, "log");

  const Config old = config_from_json(with_batch({{"zero_optimization", true}, {"allgather_size", 1000}}), "c", 1);
  EXPECT_EQ(old.zero_optimization.stage, 1);
  EXPECT_EQ(old.zero_optimization.allgather_bucket_size, 1000);
  EXPECT_TRUE(old.ignored_keys.empty());
}

// ---- the model section takes a Hugging Face config.json as it is ---------------------------

TEST(ConfigModel, HuggingFaceBertBaseConfigDropsIn) {
  const json bert_base = json::parse(R"({
    "architectures": ["BertForMaskedLM"], "attention_probs_dropout_prob": 0.1,
    "gradient_checkpointing": false, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
    "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 3072,
    "layer_norm_eps": 1e-12, "max_position_embeddings": 512, "model_type": "bert",
    "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 0,
    "position_embedding_type": "absolute", "transformers_version": "4.6.0.dev0",
    "type_vocab_size": 2, "use_cache": true, "vocab_size": 30522})");
  const Config cfg = config_from_json(with_batch({{"model", bert_base}}), "c", 1);
  EXPECT_EQ(cfg.model.hidden_size, 768);
  EXPECT_EQ(cfg.model.vocab_size, 30522);
  EXPECT_EQ(cfg.model.num_hidden_layers, 12);
  EXPECT_EQ(cfg.model.hidden_act, "gelu");
  EXPECT_DOUBLE_EQ(cfg.model.layer_norm_eps, 1e-12);
  const json extra = {{"architectures", {"BertForMaskedLM"}}, {"gradient_checkpointing", false},
                      {"position_embedding_type", "absolute"}, {"transformers_version", "4.6.0.dev0"},
                      {"use_cache", true}};
  EXPECT_EQ(cfg.model.extra, extra);
  EXPECT_TRUE(cfg.ignored_keys.empty());
  const json exported = config_to_json(cfg)["model"];
  for (const auto& item : bert_base.items())  // exported back unchanged
    EXPECT_EQ(exported[item.key()], item.value()) << item.key();

  const Config roberta = config_from_json(with_batch({{"model", {{"model_type", "roberta"}}}}), "c", 1);
  EXPECT_EQ(roberta.model.pad_token_id, 1);  // RobertaConfig's defaults
  EXPECT_EQ(roberta.model.vocab_size, 50265);
}

// ---- round trip ----------------------------------------------------------------------------

TEST(ConfigRoundTrip, ToJsonAndBackGivesTheSameConfig) {
  const json full = json::parse(R"({
    "train_batch_size": 64, "gradient_accumulation_steps": 2,
    "optimizer": {"type": "adam", "params": {"lr": 3e-4, "betas": [0.9, 0.98], "eps": 1e-6,
                  "weight_decay": 0.01, "adam_w_mode": false}, "no_decay": ["bias"]},
    "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3,
                  "cycle_first_step_size": 100, "cycle_second_stair_count": 3}},
    "fp16": {"enabled": true, "loss_scale_window": 500, "hysteresis": 4, "initial_scale_power": 12},
    "gradient_clipping": 1.0, "steps_per_print": 50, "wall_clock_breakdown": true,
    "zero_optimization": {"stage": 2, "overlap_comm": true, "reduce_bucket_size": 2e8,
                          "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "pin_memory": true},
                          "zero_quantized_gradients": true},
    "activation_checkpointing": {"partition_activations": true, "number_checkpoints": 4},
    "tensorboard": {"enabled": true, "output_path": "tb", "job_name": "j"},
    "csv_monitor": {"enabled": true},
    "wandb": {"enabled": true, "project": "x"},
    "bfloat16": {"immediate_grad_update": true},
    "model": {"model_type": "bert", "hidden_size": 128, "num_attention_heads": 2,
              "num_hidden_layers": 2, "intermediate_size": 512, "architectures": ["BertForMaskedLM"]},
    "data": {"train_files": ["a.txt", "b.txt"], "vocab_file": "vocab.txt", "max_seq_length": 64,
             "whole_word_mask": true},
    "trainer": {"env_type": "deepspeed", "epochs": 3, "seed": 18446744073709551615,
                "save_dir": "ck", "progress_bar": false}
  })");
  const Config a = config_from_json(full, "full.json", 4);
  EXPECT_EQ(a.batch.train_micro_batch_size_per_gpu, 8);
  EXPECT_EQ(a.trainer.seed, 18446744073709551615ull);
  const json dumped = config_to_json(a);
  const Config b = config_from_json(parse_json_strict(dumped.dump(2), "dump.json"), "dump.json", 4);
  EXPECT_EQ(config_to_json(b), dumped);
  EXPECT_EQ(b.ignored_keys, a.ignored_keys);
  EXPECT_EQ(a.ignored_keys, (std::vector<std::string>{"wandb", "zero_optimization.zero_quantized_gradients",
                                                       "bf16.immediate_grad_update"}));
  // spot checks that the dump carries the values, not just the same defaults twice
  EXPECT_EQ(b.optimizer.type, "Adam");
  EXPECT_FALSE(b.optimizer.adam_w_mode);
  EXPECT_DOUBLE_EQ(b.optimizer.beta2, 0.98);
  EXPECT_EQ(b.optimizer.no_decay, std::vector<std::string>{"bias"});
  EXPECT_EQ(b.scheduler.cycle_second_stair_count, 3);
  EXPECT_FALSE(b.scheduler.cycle_second_step_size.has_value());
  EXPECT_EQ(b.fp16.initial_scale_power, 12);
  EXPECT_EQ(b.zero_optimization.offload_optimizer.nvme_path, "/nvme");
  EXPECT_EQ(b.activation_checkpointing.number_checkpoints, 4);
  EXPECT_TRUE(b.activation_checkpointing_present);
  EXPECT_EQ(b.model.extra, json({{"architectures", {"BertForMaskedLM"}}}));
  EXPECT_EQ(b.data.train_files, (std::vector<std::string>{"a.txt", "b.txt"}));
  EXPECT_FALSE(b.trainer.progress_bar);
  EXPECT_EQ(dumped["wandb"], full["wandb"]);
  EXPECT_EQ(dumped["bf16"]["immediate_grad_update"], true);
  // every key is written, defaults included
  EXPECT_TRUE(dumped["zero_optimization"].contains("stage3_max_live_parameters"));
  EXPECT_TRUE(dumped["trainer"].contains("keep_last"));
  EXPECT_TRUE(dumped["data"].contains("eval_batches"));
}

// ---- CLI ----------------------------------------------------------------------------------

struct Cli {
  CLI::App app{"test"};
  ConfigFlags flags;
  Cli() { add_config_flags(app, flags); }
  bool parse(std::vector<std::string> args) {
    args.insert(args.begin(), "prog");
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    return parse_cli(app, static_cast<int>(argv.size()), argv.data());
  }
};

TEST(ConfigCli, FlagsBecomeOverridesAtTheirJsonPaths) {
  Cli cli;
  ASSERT_TRUE(cli.parse({"--config", "x.json", "--epochs", "3", "--env_type", "pytorchDDP", "--lr", "0.01",
                         "--train_files", "a.txt", "b.txt", "--no_progress_bar", "--save_safetensors",
                         "--train_batch_size", "16", "--seed", "7", "--print_config"}));
  EXPECT_EQ(cli.flags.config_path, "x.json");
  EXPECT_TRUE(cli.flags.print_config);
  const json expected = {
      {"trainer", {{"epochs", 3}, {"env_type", "pytorchDDP"}, {"progress_bar", false},
                   {"save_safetensors", true}, {"seed", 7}}},
      {"optimizer", {{"params", {{"lr", 0.01}}}}},
      {"data", {{"train_files", {"a.txt", "b.txt"}}}},
      {"train_batch_size", 16}};
  EXPECT_EQ(cli.flags.overrides, expected);
}

TEST(ConfigCli, ParseErrorsAreInputErrorsAndHelpIsNot) {
  {
    Cli cli;
    EXPECT_THROW(cli.parse({"--epochs", "three"}), InputError);
  }
  {
    Cli cli;
    try {
      cli.parse({"--no_such_flag"});
      FAIL() << "no error";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("--no_such_flag"), std::string::npos) << e.what();
    }
  }
  {
    Cli cli;
    testing::internal::CaptureStdout();
    EXPECT_FALSE(cli.parse({"--help"}));
    EXPECT_NE(testing::internal::GetCapturedStdout().find("--train_micro_batch_size_per_gpu"), std::string::npos);
  }
  {
    Cli cli;  // a flag's value goes through the file's validation
    ASSERT_TRUE(cli.parse({"--train_batch_size", "8", "--eval_interval", "-1"}));
    try {
      build_config(cli.flags, 1);
      FAIL() << "no error";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("'trainer.eval_interval' must be >= 0"), std::string::npos) << e.what();
    }
  }
}

TEST(ConfigCli, BuildConfigMergesFileAndOverrides) {
  TempFile file(R"({
    "train_batch_size": 32, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
    "trainer": {"epochs": 2, "log_interval": 5}
  })");
  Cli cli;
  // An input file given on the command line must be readable: the config file itself will do.
  ASSERT_TRUE(cli.parse({"--config", file.path(), "--lr", "0.001", "--epochs", "5", "--vocab_file", file.path()}));
  const Config cfg = build_config(cli.flags, 1);
  EXPECT_DOUBLE_EQ(cfg.optimizer.lr, 0.001);
  EXPECT_DOUBLE_EQ(cfg.optimizer.weight_decay, 0.01);  // merged, not replaced
  EXPECT_EQ(cfg.trainer.epochs, 5);
  EXPECT_EQ(cfg.trainer.log_interval, 5);
  EXPECT_EQ(cfg.data.vocab_file, file.path());
  EXPECT_EQ(cfg.batch.train_batch_size, 32);

  Cli no_file;  // no --config: {} plus the flags
  ASSERT_TRUE(no_file.parse({"--train_micro_batch_size_per_gpu", "4", "--lr", "0.5"}));
  const Config bare = build_config(no_file.flags, 2);
  EXPECT_EQ(bare.batch.train_batch_size, 8);
  EXPECT_EQ(bare.optimizer.type, "AdamW");
  EXPECT_DOUBLE_EQ(bare.optimizer.lr, 0.5);
}

TEST(ConfigCli, BatchOverridesKeepTheFileConsistent) {
  struct Case {
    json file;
    json cli;
    int64_t world_size;
    int64_t train, micro, accum;
    std::string error;
  };
  const json file_triple = {{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", 8},
                            {"gradient_accumulation_steps", 4}};
  const std::vector<Case> cases = {
      // the file's global batch is kept, GA re-derived
      {file_triple, {{"train_micro_batch_size_per_gpu", 16}}, 1, 32, 16, 2, ""},
      {file_triple, {{"gradient_accumulation_steps", 8}}, 1, 32, 4, 8, ""},
      // a new global batch keeps the file's micro batch
      {file_triple, {{"train_batch_size", 64}}, 1, 64, 8, 8, ""},
      // consistent with the file: nothing dropped
      {file_triple, {{"train_micro_batch_size_per_gpu", 8}}, 1, 32, 8, 4, ""},
      // the file was written for world size 1; at world size 2 the CLI micro batch rules
      {file_triple, {{"train_micro_batch_size_per_gpu", 4}}, 2, 32, 4, 4, ""},
      // nothing in the file fits: the CLI keys alone decide
      {{{"train_batch_size", 30}}, {{"train_micro_batch_size_per_gpu", 4}}, 1, 4, 4, 1, ""},
      // the CLI keys themselves disagree: their own error
      {file_triple, {{"train_batch_size", 33}, {"train_micro_batch_size_per_gpu", 16}}, 2, 0, 0, 0,
       "not divisible"},
      // no CLI batch key: the file's triple is checked as it is
      {file_triple, {{"trainer", {{"epochs", 1}}}}, 2, 0, 0, 0, "batch sizes disagree"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.file.dump() + " + " + c.cli.dump());
    TempFile file(c.file.dump());
    ConfigFlags flags;
    flags.config_path = file.path();
    flags.overrides = c.cli;
    if (c.error.empty()) {
      const Config cfg = build_config(flags, c.world_size);
      EXPECT_EQ(cfg.batch.train_batch_size, c.train);
      EXPECT_EQ(cfg.batch.train_micro_batch_size_per_gpu, c.micro);
      EXPECT_EQ(cfg.batch.gradient_accumulation_steps, c.accum);
    } else {
      try {
        build_config(flags, c.world_size);
        ADD_FAILURE() << "no error";
      } catch (const InputError& e) {
        EXPECT_NE(std::string(e.what()).find(c.error), std::string::npos) << e.what();
      }
    }
  }
}

}  // namespace
}  // namespace polytrain
