// `zero_to_fp32 CHECKPOINT_DIR OUT.safetensors [--tag TAG]`: the fp32 model of any checkpoint
// (every env_type, grid and ZeRO stage), without the run (DeepSpeed's zero_to_fp32.py): the
// trainable parameters from the shards' fp32 master weights where the optimizer kept them
// (ZeRO, any number of ranks and TP parts), everything else (frozen parameters, buffers, the
// weights of a whole-parameter optimizer) from the checkpoint's consolidated model, written as
// safetensors under the model's parameter names. Every element of every parameter must come
// from exactly one shard, and the parameters must match the saved model's names and shapes.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <map>
#include <string>

#include <torch/serialize/archive.h>
#include <torch/torch.h>

#include "polytrain/common/cli_config.h"
#include "polytrain/common/error.h"
#include "polytrain/common/main_guard.h"
#include "polytrain/checkpoint/safetensors.h"
#include "polytrain/parallel/zero/zero_export.h"
#include "polytrain/checkpoint/checkpoint.h"

namespace {

using namespace polytrain;

int zero_to_fp32_main(int argc, char** argv) {
  CLI::App app{"Consolidate a checkpoint (any env_type, grid, ZeRO stage) into one fp32 safetensors file"};
  std::string dir, out, tag;
  app.add_option("checkpoint_dir", dir, "the save_dir holding <tag>/ and latest")->required();
  app.add_option("output", out, "the .safetensors file to write")->required();
  app.add_option("--tag", tag, "checkpoint tag (default: the one `latest` names)");
  if (!parse_cli(app, argc, argv)) return 0;  // --help
  if (tag.empty()) tag = latest_checkpoint_tag(dir);
  const CheckpointReader ck(dir, tag);
  const ShardReader shards(ck);
  const ZeroConsolidated z = consolidate_zero_shards(shards);
  NamedTensors model;
  PT_INPUT_CHECK(ck.has_file("state.pt"), ck.dir(), ": no state.pt (the consolidated model)");
  ck.read_archive("state.pt", [&](torch::serialize::InputArchive& a) {
    torch::serialize::InputArchive m;
    a.read("model", m);
    model = load_named_tensors_archive(m);
  });
  std::map<std::string, size_t> where;
  for (size_t i = 0; i < model.size(); ++i) where[model[i].first] = i;
  for (const auto& [name, p] : z.params) {
    auto it = where.find(name);
    PT_INPUT_CHECK(it != where.end(), ck.path("state.pt"), ": the shards hold parameter '", name,
                   "', which the saved model does not have");
    PT_INPUT_CHECK(model[it->second].second.sizes() == c10::IntArrayRef(p.shape), ck.dir(), ": parameter '", name,
                   "' has shape ", c10::IntArrayRef(p.shape), " in the shards and ", model[it->second].second.sizes(),
                   " in the model");
    if (p.master.defined()) model[it->second].second = p.master;
  }
  int64_t total = 0;
  for (auto& [name, t] : model) {
    if (t.is_floating_point()) t = t.to(torch::kFloat);
    total += t.numel();
  }
  save_safetensors(out, model, {{"format", "pt"}, {"source", ck.dir()}, {"step", std::to_string(z.step)}});
  std::printf("%s: %zu tensors, %lld elements (%zu trainable parameters, %lld elements from %lld ZeRO shards, step %lld)\n",
              out.c_str(), model.size(), static_cast<long long>(total), z.params.size(),
              static_cast<long long>(z.elements), static_cast<long long>(z.shards), static_cast<long long>(z.step));
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return polytrain::run_main([&] { return zero_to_fp32_main(argc, argv); }); }
