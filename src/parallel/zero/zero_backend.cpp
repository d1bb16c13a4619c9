// ZeroBackend (see zero_backend.h): flat partitioned buffers, the bucketed reductions of
// stages 0-2, the partition update (CPU Adam on CPU memory, the same math in tensor ops on a
// GPU), the in-place parameter gather, and checkpoints by parameter slice that load at any
// data-parallel size.
#include "polytrain/parallel/zero/zero_backend.h"

#include "polytrain/parallel/zero/zero_export.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <sstream>
#include <unordered_set>

#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/nn/module.h>
#include <torch/serialize/archive.h>
#include <torch/torch.h>

#include "polytrain/common/error.h"
#include "polytrain/parallel/comm/rank_ops.h"
#include "polytrain/parallel/parallel_dims.h"
#include "polytrain/parallel/replicated_backend.h"
#include "polytrain/parallel/tensor_parallel/tp_plan.h"
#include "polytrain/parallel/pipeline/pipeline_stage.h"
#include "polytrain/parallel/tensor_parallel/tp_transform.h"
#include "polytrain/parallel/universal_state.h"
#include "polytrain/parallel/update.h"
#include "polytrain/checkpoint/checkpoint.h"
#include "polytrain/models/layer_params.h"
#include "polytrain/optim/blockwise_quant.h"
#include "polytrain/optim/cpu_adam.h"
#include "polytrain/optim/optimizer_registry.h"
#include "polytrain/optim/optimizers.h"
#include "polytrain/optim/optimizers_8bit.h"

namespace polytrain {

using detail::cat;

namespace {

// Adam8bit / AdamW8bit moments of one partition, in runs of elements: fp32 where the parameter
// keeps 32-bit state by the whole-parameter optimizers' rule (optim8bit::keeps_32bit_state:
// min_8bit_size, keep_32bit_state), 8-bit elsewhere (padding included), each 8-bit run's blocks
// (quant8::kBlockSize) counted from its start. The same parameters get the same kind of state
// as under pytorch, and at one rank the same blocks.
struct Moments8bit {
  struct Run {
    int64_t begin = 0, length = 0;
    bool full = false;     ///< fp32 moments m, v; else q8
    QuantizedMoments q8;
    at::Tensor m, v;
  };
  bool on = false;  ///< an 8-bit optimizer's (a partition may have no runs)
  std::vector<Run> runs;

  bool defined() const { return on; }

  /// The runs of the partition [base, base + part) of layout `l`, whose pieces are `owned`.
  static Moments8bit make(const OptimizerConfig& cfg, const ZeroLayout& l, const std::vector<ZeroLayout::Piece>& owned,
                          int64_t base) {
    Moments8bit m;
    m.on = true;
    auto add = [&](int64_t begin, int64_t length, bool full) {
      if (length <= 0) return;
      if (!m.runs.empty() && m.runs.back().full == full && m.runs.back().begin + m.runs.back().length == begin) {
        m.runs.back().length += length;
      } else {
        m.runs.push_back(Run{begin, length, full, {}, {}, {}});
      }
    };
    int64_t pos = 0;
    for (const auto& p : owned) {
      const auto& en = l.entries[p.entry];
      add(pos, p.flat_begin - base - pos, false);  // padding between parameters
      add(p.flat_begin - base, p.length, optim8bit::keeps_32bit_state(cfg, en.name, en.numel));
      pos = p.flat_begin - base + p.length;
    }
    add(pos, l.part - pos, false);
    for (auto& r : m.runs) {
      if (r.full) {
        r.m = torch::zeros({r.length}, torch::kFloat);
        r.v = torch::zeros({r.length}, torch::kFloat);
      } else {
        r.q8 = QuantizedMoments::zeros(r.length);
      }
    }
    return m;
  }

  int64_t bytes() const {
    int64_t b = 0;
    for (const auto& r : runs) b += r.full ? 8 * r.length : r.q8.bytes();
    return b;
  }

  /// "exp_avg" or "exp_avg_sq" of the whole partition, fp32 (n = the partition's elements).
  at::Tensor dequantized(const std::string& stat, int64_t n) const {
    at::Tensor out = torch::zeros({n}, torch::kFloat);
    for (const auto& r : runs)
      out.narrow(0, r.begin, r.length).copy_(r.full ? (stat == "exp_avg" ? r.m : r.v) : r.q8.dequantized(stat));
    return out;
  }

  /// Sets "exp_avg" or "exp_avg_sq" from fp32 values of the whole partition (quantizing the 8-bit runs).
  void assign(const std::string& stat, const at::Tensor& values) {
    for (auto& r : runs) {
      const at::Tensor x = values.narrow(0, r.begin, r.length);
      if (r.full) (stat == "exp_avg" ? r.m : r.v).copy_(x);
      else r.q8.assign(stat, x);
    }
  }

  /// One Adam step of every run: the 8-bit kernel, or CPU Adam's on the fp32 runs.
  void step(const cpu_adam::Hyper& h, int64_t step, float* master, const float* grad) {
    for (auto& r : runs) {
      if (r.full) {
        cpu_adam::step(h, step, master + r.begin, grad + r.begin, r.m.data_ptr<float>(), r.v.data_ptr<float>(),
                       r.length);
      } else {
        optim8bit::adam_step(h, step, master + r.begin, grad + r.begin, r.q8.view(), r.length);
      }
    }
  }

  /// The runs, for the checkpoint's fingerprint.
  std::string describe() const {
    std::ostringstream f;
    for (const auto& r : runs) f << " " << r.begin << "+" << r.length << (r.full ? "f" : "q");
    return f.str();
  }
};

}  // namespace

struct ZeroBackend::Group {
  size_t index = 0;
  double weight_decay = 0.0;
  at::Tensor flat;        ///< [padded] the parameters' storage (their dtype, the device)
  at::Tensor flat_part;   ///< the owned partition of flat
  at::Tensor master;      ///< [part] fp32 master weights (flat_part itself when master_is_view)
  bool master_is_view = false;
  at::Tensor exp_avg, exp_avg_sq;  ///< [part] fp32, beside master (undefined with 8-bit state)
  Moments8bit q8;                  ///< Adam8bit / AdamW8bit: the moments, in runs over the partition
  at::Tensor grad_full;   ///< stage 0/1: [padded] the .grad views' storage
  at::Tensor grad;        ///< [part] the owned, reduced gradient (a view of grad_full at stage 0/1)
  at::Tensor master_grad; ///< what the optimizer reads: grad itself, or its fp32 / CPU copy
  at::Tensor copy_out;    ///< offload with half-precision parameters off the CPU: [part] uint16 (CPU)
};

struct ZeroBackend::Bucket {
  std::vector<size_t> params;                       ///< trainable parameter indices
  std::vector<std::pair<int64_t, int64_t>> ranges;  ///< per group: flat [lo, hi) (empty: lo == hi)
  std::vector<int64_t> staging_offset;              ///< per group: where its range starts in a reduce buffer
  int64_t numel = 0;
  size_t pending = 0;
};

// Stage 3: a unit is what is gathered and let go at once: one layer's parameters (a module the
// model's loop runs through in_layer), the parameters outside the layers (embeddings, final
// norm, heads: gathered for a whole step), or the persistent ones (below
// stage3_param_persistence_threshold: never let go, updated and broadcast as at stage 2).
struct ZeroBackend::Unit {
  const torch::nn::Module* layer = nullptr;
  std::string name;
  std::vector<size_t> groups;
  size_t params = 0;    ///< trainable parameters in it
  size_t pending = 0;   ///< of which no gradient arrived yet in this backward
  bool persistent = false;
  bool gathered = true;
  int users = 0;        ///< forwards running in it (nested: a checkpointed block recomputed)
  int64_t numel = 0;    ///< elements of its flat buffers (padded)
  std::vector<std::unique_ptr<CommWork>> inflight;  ///< a prefetch under way: its broadcasts
};

namespace {

// The layer hooks' way to the backend: through a slot the backend clears when destroyed.
struct ZeroLayerParams : LayerParams {
  explicit ZeroLayerParams(std::shared_ptr<ZeroBackend*> owner) : owner_(std::move(owner)) {}
  void fetch(const torch::nn::Module& layer, bool for_backward) override {
    if (*owner_ != nullptr) (*owner_)->fetch_layer(layer, for_backward);
  }
  void done(const torch::nn::Module& layer) override {
    if (*owner_ != nullptr) (*owner_)->layer_done(layer);
  }
  std::shared_ptr<ZeroBackend*> owner_;
};

}  // namespace

struct ZeroBackend::InFlight {
  std::vector<std::unique_ptr<CommWork>> works;
  struct Mine {
    size_t group;
    int64_t staging_offset, part_offset, length;
  };
  std::vector<Mine> mine;  ///< stage 2: the reduced slices this rank owns, to add to its gradient
  at::Tensor staging;
};

namespace {

// Post-hook of a parameter's AccumulateGrad node (stage 2): reports the gradient as complete.
// It reaches the backend through a slot the backend clears when destroyed (the autograd graph
// can outlive it).
struct ZeroGradHook : torch::autograd::FunctionPostHook {
  ZeroGradHook(std::shared_ptr<ZeroBackend*> owner, size_t index) : owner_(std::move(owner)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (*owner_ != nullptr) (*owner_)->grad_ready(index_);
    return outputs;
  }
  std::shared_ptr<ZeroBackend*> owner_;
  size_t index_;
};

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// What an 8-bit partition's blocks depend on: the partitions of every group this rank owns,
// the pieces in them, the grid, and the runs of 8-bit and fp32 state (`runs`, per group). A
// checkpoint's raw 8-bit state is restored only where this matches (the same model on the same
// grid with the same rules); anywhere else the fp32 pieces are requantized.
std::string partition_fingerprint(const std::vector<ZeroLayout>& layouts, int64_t owners, int64_t owner,
                                  const RankContext& ctx, const std::vector<std::string>& runs) {
  std::ostringstream f;
  // The 8-bit block: a checkpoint of blocks of another size (no "block" in it) takes the
  // universal layout's path, which requantizes.
  f << "owners " << owners << " owner " << owner << " tp " << ctx.tp_rank << "/" << ctx.tp_size << " block "
    << quant8::kBlockSize;
  for (size_t g = 0; g < layouts.size(); ++g) {
    f << " | group " << g << " part " << layouts[g].part;
    for (const auto& p : layouts[g].owned(owner))
      f << "; " << layouts[g].entries[p.entry].name << " " << p.param_begin << "+" << p.length;
    f << "; runs" << (g < runs.size() ? runs[g] : std::string());
  }
  return f.str();
}

// DeepSpeed's Adam / AdamW over the owned fp32 partitions: the CPU kernel (cpu_adam.h) when
// the master weights are in CPU memory, the same formula in tensor ops on a GPU. Writes the
// updated weights back into the parameters' partition (fused into the kernel as bf16 / fp16
// when the parameters are half precision). Adam8bit / AdamW8bit: over CPU master weights, the
// 8-bit kernel (cpu_optim_8bit.h) on the partition's 8-bit runs and CPU Adam's on its fp32 runs
// (Moments8bit).
class PartitionAdam final : public Optimizer {
 public:
  struct Slot {
    at::Tensor master, exp_avg, exp_avg_sq, flat_part, copy_out;
    bool master_is_view = false;
    double weight_decay = 0.0;
    Moments8bit q8;  ///< defined for the 8-bit optimizers (then exp_avg / exp_avg_sq are not)
  };
  PartitionAdam(const OptimizerConfig& cfg, std::vector<Slot> slots) : slots_(std::move(slots)) {
    name_ = cfg.type;
    lr_ = cfg.lr;
    beta1_ = cfg.beta1;
    beta2_ = cfg.beta2;
    eps_ = cfg.eps;
    adam_w_mode_ = lower(cfg.type) == "adamw" || lower(cfg.type) == "adamw8bit" || cfg.adam_w_mode;  // Adam, CPUAdam, Adam8bit: as configured
    bias_correction_ = cfg.bias_correction;
  }
  std::string name() const override { return name_; }
  void step() override {
    ++step_;
    for (auto& s : slots_) update(s);
  }
  void zero_grad() override {
    for (auto& s : slots_)
      if (s.master.grad().defined()) s.master.mutable_grad().zero_();
  }
  void set_lr(double lr) override { lr_ = lr; }
  bool has_beta1() const override { return true; }
  void set_beta1(double beta1) override {
    check_scheduled_beta1(beta1);
    beta1_ = beta1;
  }
  void save(torch::serialize::OutputArchive&) const override {
    throw InternalError("ZeRO saves its optimizer state by parameter slice (ZeroBackend::save_shard)");
  }
  void load(torch::serialize::InputArchive&, const std::string&) override {
    throw InternalError("ZeRO loads its optimizer state by parameter slice (ZeroBackend::load_shards)");
  }
  torch::optim::Optimizer& torch_optimizer() override {
    throw InternalError("ZeRO's partition optimizer has no libtorch optimizer underneath");
  }
  int64_t step_count() const { return step_; }
  void set_step_count(int64_t s) { step_ = s; }

 private:
  void update(Slot& s) {
    const at::Tensor& g = s.master.grad();
    if (!g.defined() || s.master.numel() == 0) return;
    cpu_adam::Hyper h;
    h.lr = static_cast<float>(lr_);
    h.beta1 = static_cast<float>(beta1_);
    h.beta2 = static_cast<float>(beta2_);
    h.eps = static_cast<float>(eps_);
    h.weight_decay = static_cast<float>(s.weight_decay);
    h.adam_w_mode = adam_w_mode_;
    h.bias_correction = bias_correction_;
    const auto half = s.flat_part.scalar_type();
    if (s.q8.defined()) {  // CPU master weights (build_partitions checked)
      s.q8.step(h, step_, s.master.data_ptr<float>(), g.data_ptr<float>());
      if (!s.master.is_inference()) s.master.unsafeGetTensorImpl()->bump_version();
      if (!s.master_is_view) s.flat_part.copy_(s.master);  // to the parameters' dtype and device
      return;
    }
    if (s.master.is_cpu()) {
      // Copy-out fused into the kernel when the parameters are half precision.
      cpu_adam::CopyOut copy = cpu_adam::CopyOut::kNone;
      uint16_t* out = nullptr;
      if (!s.master_is_view && (half == at::kBFloat16 || half == at::kHalf)) {
        copy = half == at::kBFloat16 ? cpu_adam::CopyOut::kBf16 : cpu_adam::CopyOut::kFp16;
        at::Tensor dst = s.flat_part.is_cpu() ? s.flat_part : s.copy_out;
        out = reinterpret_cast<uint16_t*>(dst.data_ptr());
      }
      cpu_adam::step(h, step_, s.master.data_ptr<float>(), g.data_ptr<float>(), s.exp_avg.data_ptr<float>(),
                     s.exp_avg_sq.data_ptr<float>(), s.master.numel(), copy, out);
      // Written through raw pointers: tell autograd the tensors changed, as in-place ops would.
      if (!s.master.is_inference()) s.master.unsafeGetTensorImpl()->bump_version();
      if (out != nullptr && s.flat_part.is_cpu() && !s.flat_part.is_inference())
        s.flat_part.unsafeGetTensorImpl()->bump_version();
      if (s.master_is_view) return;
      if (copy != cpu_adam::CopyOut::kNone) {
        if (!s.flat_part.is_cpu()) s.flat_part.copy_(s.copy_out.view(half));  // 2 bytes per parameter
      } else {
        s.flat_part.copy_(s.master);
      }
      return;
    }
    adam_torch(h, s.master, g, s.exp_avg, s.exp_avg_sq);
    if (!s.master_is_view) s.flat_part.copy_(s.master);
  }

  // The kernel's formula in tensor ops (for master weights on a GPU).
  void adam_torch(const cpu_adam::Hyper& h, at::Tensor& p, const at::Tensor& grad, at::Tensor& m, at::Tensor& v) {
    torch::NoGradGuard no_grad;
    const double bc1 = h.bias_correction ? 1.0 - std::pow(beta1_, step_) : 1.0;
    const double bc2 = h.bias_correction ? 1.0 - std::pow(beta2_, step_) : 1.0;
    const double step_size = lr_ / bc1;
    at::Tensor g = grad;
    if (h.weight_decay > 0 && !h.adam_w_mode) g = grad.add(p, h.weight_decay);
    m.mul_(beta1_).add_(g, 1.0 - beta1_);
    v.mul_(beta2_).addcmul_(g, g, 1.0 - beta2_);
    at::Tensor denom = v.sqrt().div_(std::sqrt(bc2)).add_(eps_);
    if (h.weight_decay > 0 && h.adam_w_mode) p.add_(p, -lr_ * h.weight_decay);
    p.addcdiv_(m, denom, -step_size);
  }

  std::vector<Slot> slots_;
  std::string name_;
  double lr_ = 1e-3, beta1_ = 0.9, beta2_ = 0.999, eps_ = 1e-8;
  bool adam_w_mode_ = true, bias_correction_ = true;
  int64_t step_ = 0;
};

}  // namespace

ZeroBackend::ZeroBackend(const Config& cfg, std::unique_ptr<Communicator> world)
    : comm_(std::move(world)), alive_(std::make_shared<ZeroBackend*>(this)) {
  const auto& t = cfg.trainer;
  const auto& z = cfg.zero_optimization;
  ctx_.device = parse_device(t.pytorch_device);
  if (!comm_) comm_ = world_communicator(t, ctx_.device);
  // Every compatibility check, as env_type deepspeed unless the grid is deepspeed+mpu's.
  Config as_zero = cfg;
  if (t.env_type != "deepspeed+mpu") as_zero.trainer.env_type = "deepspeed";
  const ParallelDims dims = resolve_parallel_dims(as_zero, comm_->size());
  PT_CHECK(dims.strategy == DpStrategy::kZero || dims.zero_stage == 0, "ZeroBackend built for ", dims.describe());
  name_ = t.env_type == "deepspeed+mpu" ? t.env_type : "deepspeed";
  stage_ = dims.zero_stage;
  offload_ = dims.offload_optimizer;
  pin_memory_ = z.offload_optimizer.pin_memory;
  offload_param_ = stage_ == 3 && z.offload_param.device == "cpu";
  if (offload_param_) pin_memory_ = pin_memory_ || z.offload_param.pin_memory;
  persistence_threshold_ = z.stage3_param_persistence_threshold;
  prefetch_bucket_ = z.stage3_prefetch_bucket_size;
  max_live_ = z.stage3_max_live_parameters;
  max_reuse_ = z.stage3_max_reuse_distance;
  overlap_ = z.overlap_comm;
  reduce_bucket_ = z.reduce_bucket_size;
  allgather_bucket_ = z.allgather_bucket_size;
  micro_ = cfg.batch.train_micro_batch_size_per_gpu;
  accumulation_ = cfg.batch.gradient_accumulation_steps;
  global_batch_ = cfg.batch.train_batch_size;
  clip_ = cfg.gradient_clipping;
  set_data_parallel_context(ctx_, *comm_);
  // tp > 1: ZeRO runs over this rank's DP group, the TP transform over its TP group.
  TpGrid grid = split_tp_grid(comm_, dims.tp, t.seed, name_, ctx_, dims.pp);
  world_ = std::move(grid.world);
  tp_group_ = std::move(grid.tp_group);
  pp_group_ = std::move(grid.pp_group);
  tp_ = std::move(grid.transform);
  if (pp_group_) {  // pp > 1: ZeRO partitions this stage's parameters over its dp group
    stage_grid_ = world_->split(static_cast<int>(ctx_.pp_rank), static_cast<int>(ctx_.rank));
    pipe_ = std::make_unique<PipelineStage>(*pp_group_, cfg.pipeline, cfg.batch.gradient_accumulation_steps, ctx_.device);
  }
  owners_ = stage_ == 0 ? 1 : ctx_.dp_size;
  owner_ = stage_ == 0 ? 0 : ctx_.dp_rank;
}

ZeroBackend::~ZeroBackend() {
  *alive_ = nullptr;
  for (const auto& [layer, u] : unit_of_layer_) set_layer_params(*layer, nullptr);
  for (auto& f : flight_)
    if (f)
      for (auto& w : f->works) w.reset();  // waits for collectives still writing
}

int64_t ZeroBackend::next_micro_batch(int64_t micro_steps_done, int64_t /*samples_done*/) const {
  return micro_steps_done < accumulation_ ? micro_ : 0;
}

// Phase 0: ZeRO partitions the optimizer's state by element; what cannot be is refused.
void ZeroBackend::check_optimizer(const OptimizerConfig& o) const {
  const OptimizerEntry& opt = optimizer_entry(o.type);
  PT_INPUT_CHECK(opt.shardable, "optimizer.type '", o.type, "' cannot be sharded by env_type ", name_,
                 " (ZeRO partitions optimizer state by element; ", opt.not_shardable_because,
                 "; at every stage, 0 included): use Adam/AdamW, or env_type pytorchDDP (the same data "
                 "parallelism over whole parameters)");
  PT_INPUT_CHECK(!o.amsgrad, "optimizer.params.amsgrad is not supported by env_type deepspeed");
  PT_INPUT_CHECK(o.lr >= 0, "optimizer.params.lr must be >= 0, got ", o.lr);
  PT_INPUT_CHECK(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1,
                 "optimizer.params.betas must be in [0, 1), got [", o.beta1, ", ", o.beta2, "]");
}

// The job in order: the optimizer check, the model transform (TP), every dp rank from dp rank
// 0's weights, the trainable parameters by group, the flat partitioned buffers and the
// optimizer over the owned partitions, the norm's views, the gradient buckets.
void ZeroBackend::prepare(std::shared_ptr<torch::nn::Module> model, const Config& cfg) {
  check_optimizer(cfg.optimizer);
  model_ = std::move(model);
  if (tp_) tp_->apply(*model_);  // the model transform first: ZeRO partitions this rank's parts
  if (pipe_) {  // then the stage's layers: ZeRO partitions what this stage trains
    pipe_->apply(*model_);
    // Every stage learns whether one of them has nothing to partition, so all fail alike.
    bool own = false;
    for (const auto& item : model_->named_parameters(true)) own = own || pipe_->trains(item.key());
    const double without = pipe_->sum(own ? 0.0 : 1.0);
    PT_INPUT_CHECK(without == 0, without, " of the ", pipe_->stages(), " pipeline stages train no parameter of their "
                   "own (every parameter they read is trained on another stage, as ALBERT's shared layer): ZeRO "
                   "partitions a stage's own parameters; use fewer stages or env_type pytorchDDP");
  }
  model_->to(ctx_.device);
  broadcast_module_state(*comm_, *model_);  // every dp rank starts from dp rank 0's weights

  const std::vector<ParamGroup> split = collect_params(cfg.optimizer);
  build_partitions(cfg.optimizer, split);
  build_norm_views();
  build_buckets();
}

// Phase 1: the trainable parameters in registration order, each with its group and place in it.
std::vector<ParamGroup> ZeroBackend::collect_params(const OptimizerConfig& o) {
  NamedParams named;
  for (const auto& item : model_->named_parameters(/*recurse=*/true))
    if (!pipe_ || !pipe_->mirrors(item.key())) named.emplace_back(item.key(), item.value());  // a mirror trains elsewhere
  std::vector<ParamGroup> split = split_by_decay(o, named);
  if (stage_ == 3) split = split_by_unit(split);
  // Registration order over the groups (split_by_decay keeps it within each group).
  std::map<const void*, std::pair<size_t, size_t>> where;
  for (size_t g = 0; g < split.size(); ++g)
    for (size_t e = 0; e < split[g].params.size(); ++e) where[split[g].params[e].second.unsafeGetTensorImpl()] = {g, e};
  at::ScalarType dtype = split.front().params.front().second.scalar_type();
  std::unordered_set<const void*> seen;
  for (const auto& [name, p] : named) {
    auto it = where.find(p.unsafeGetTensorImpl());
    if (it == where.end() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    PT_INPUT_CHECK(p.scalar_type() == dtype, "env_type deepspeed: trainable parameters must share one dtype; '", name,
                   "' is ", c10::toString(p.scalar_type()), ", others ", c10::toString(dtype));
    params_.push_back(p);
    group_of_.push_back(it->second.first);
    entry_of_.push_back(it->second.second);
    if (stage_ == 3) {
      Unit& u = *units_[unit_of_group_[it->second.first]];
      unit_of_param_.push_back(unit_of_group_[it->second.first]);
      ++u.params;
    }
  }
  return split;
}

// Stage 3's units: each module of the model marked LayerUnit (the outermost ones: a block's
// own sub-layers are in its unit), the parameters outside them, the persistent ones; each
// decay group split by unit, in the units' order.
std::vector<ParamGroup> ZeroBackend::split_by_unit(const std::vector<ParamGroup>& split) {
  std::vector<std::pair<std::string, const torch::nn::Module*>> layers;  // name prefix, module
  for (const auto& item : model_->named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    if (dynamic_cast<const LayerUnit*>(item.value().get()) == nullptr) continue;
    const std::string prefix = item.key() + ".";
    const bool nested = std::any_of(layers.begin(), layers.end(), [&](const auto& l) { return prefix.rfind(l.first, 0) == 0; });
    if (!nested) layers.emplace_back(prefix, item.value().get());
  }
  units_.push_back(std::make_unique<Unit>());
  units_.back()->name = "outside the layers";
  root_ = 0;
  for (const auto& [prefix, m] : layers) {
    units_.push_back(std::make_unique<Unit>());
    units_.back()->layer = m;
    units_.back()->name = prefix.substr(0, prefix.size() - 1);
    unit_of_layer_[m] = units_.size() - 1;
  }
  units_.push_back(std::make_unique<Unit>());
  const size_t persistent = units_.size() - 1;
  units_.back()->persistent = true;
  units_.back()->name = "persistent";
  auto unit_of = [&](const std::string& name, const at::Tensor& p) -> size_t {
    if (p.numel() < persistence_threshold_) return persistent;
    for (size_t i = 0; i < layers.size(); ++i)
      if (name.rfind(layers[i].first, 0) == 0) return i + 1;
    return root_;
  };
  std::vector<ParamGroup> out;
  for (size_t u = 0; u < units_.size(); ++u)
    for (const auto& g : split) {
      ParamGroup part;
      part.weight_decay = g.weight_decay;
      for (const auto& [name, p] : g.params)
        if (unit_of(name, p) == u) part.params.emplace_back(name, p);
      if (part.params.empty()) continue;
      units_[u]->groups.push_back(out.size());
      unit_of_group_.push_back(u);
      out.push_back(std::move(part));
    }
  return out;
}

bool ZeroBackend::partitioned(size_t group) const {
  return stage_ == 3 && !units_[unit_of_group_[group]]->persistent;
}

bool ZeroBackend::unit_gathered(size_t u) const { return units_.at(u)->gathered; }

void ZeroBackend::start_gather(size_t u) {
  Unit& unit = *units_[u];
  for (size_t g : unit.groups) {
    Group& grp = *groups_[g];
    const ZeroLayout& l = layouts_[g];
    c10::StorageImpl* storage = grp.flat.storage().unsafeGetStorageImpl();
    const size_t nbytes = static_cast<size_t>(l.padded) * grp.flat.element_size();
    storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
    storage->set_nbytes(nbytes);
    gathered_bytes_ += static_cast<int64_t>(nbytes);
    broadcast_partitions(g, unit.inflight);
  }
  live_elements_ += unit.numel;
  gathered_bytes_peak_ = std::max(gathered_bytes_peak_, gathered_bytes_);
  // Marked gathered with its broadcasts possibly under way: whoever uses it calls fetch_unit,
  // which waits for them.
  unit.gathered = true;
}

void ZeroBackend::fetch_unit(size_t u) {
  Unit& unit = *units_[u];
  if (!unit.gathered) start_gather(u);
  for (auto& w : unit.inflight) w->wait();
  unit.inflight.clear();
}

void ZeroBackend::release_unit(size_t u) {
  Unit& unit = *units_[u];
  if (!unit.gathered || unit.persistent || unit.users > 0 || holding_all_ > 0 || released_model_) return;
  for (auto& w : unit.inflight) w->wait();  // a prefetch not used in the end
  unit.inflight.clear();
  for (size_t g : unit.groups) {
    Group& grp = *groups_[g];
    c10::StorageImpl* storage = grp.flat.storage().unsafeGetStorageImpl();
    gathered_bytes_ -= static_cast<int64_t>(storage->nbytes());
    storage->set_data_ptr_noswap(at::DataPtr(nullptr, grp.flat.device()));
    storage->set_nbytes(0);
  }
  live_elements_ -= unit.numel;
  unit.gathered = false;
}

// The parameter coordinator (DeepSpeed's): the first step records the order in which the
// layers ask for their parameters (forwards, backwards, recomputations, every micro-batch);
// later steps follow it with a cursor. A layer done with its parameters keeps them when it
// asks again within stage3_max_reuse_distance elements of others' (and the gathered ones stay
// within stage3_max_live_parameters); each request starts the gathers of the next layers in
// the trace, up to stage3_prefetch_bucket_size elements and the live limit, in the background.
// Every rank runs the same layers in the same order, so all issue the same collectives.
void ZeroBackend::note_request(size_t u) {
  if (tracing_) {
    trace_.push_back(u);
    return;
  }
  if (!traced_ || !in_step_) return;
  if (cursor_ < trace_.size() && trace_[cursor_] == u) {
    ++cursor_;
    return;
  }
  // Off the trace (another path than the first step's): on from the next request of this
  // layer, or no more prefetch in this step.
  size_t j = cursor_;
  while (j < trace_.size() && trace_[j] != u) ++j;
  cursor_ = j < trace_.size() ? j + 1 : trace_.size();
}

bool ZeroBackend::reused_soon(size_t u) const {
  if (!traced_ || !in_step_ || live_elements_ > max_live_) return false;
  int64_t between = 0;
  for (size_t j = cursor_; j < trace_.size(); ++j) {
    if (trace_[j] == u) return true;
    between += units_[trace_[j]]->numel;
    if (between > max_reuse_) return false;
  }
  return false;
}

void ZeroBackend::prefetch() {
  if (!traced_ || !in_step_ || prefetch_bucket_ <= 0) return;
  int64_t budget = prefetch_bucket_;
  for (size_t j = cursor_; j < trace_.size(); ++j) {
    Unit& next = *units_[trace_[j]];
    if (next.gathered) continue;
    if (next.numel > budget || live_elements_ + next.numel > max_live_) break;
    start_gather(trace_[j]);
    budget -= next.numel;
    ++prefetched_;
  }
}

void ZeroBackend::hold_all() {
  if (stage_ != 3) return;
  for (size_t u = 0; u < units_.size(); ++u) fetch_unit(u);
  ++holding_all_;
}

void ZeroBackend::let_go_all() {
  if (stage_ != 3) return;
  if (holding_all_ > 0) --holding_all_;
  for (size_t u = 0; u < units_.size(); ++u) release_unit(u);
}

void ZeroBackend::fetch_layer(const torch::nn::Module& layer, bool for_backward) {
  const auto it = unit_of_layer_.find(&layer);
  if (it == unit_of_layer_.end()) return;
  if (!for_backward) ++units_[it->second]->users;
  if (holding_all_ > 0) return;
  note_request(it->second);
  fetch_unit(it->second);
  prefetch();
}

void ZeroBackend::layer_done(const torch::nn::Module& layer) {
  const auto it = unit_of_layer_.find(&layer);
  if (it == unit_of_layer_.end()) return;
  Unit& unit = *units_[it->second];
  if (unit.users > 0) --unit.users;
  // Let go after the forward unless asked again soon; in a backward (a checkpointed block
  // recomputed) the parameters are fetched again by the recomputed output's backward.
  if (!reused_soon(it->second)) release_unit(it->second);
}

std::string ZeroBackend::pipeline_layout() const { return pipe_ ? pipe_->layout() : ""; }

at::Tensor ZeroBackend::eval_forward(const std::map<std::string, at::Tensor>& inputs) {
  PT_CHECK(pipe_ != nullptr, "eval_forward without a pipeline");
  return pipe_->forward_only(inputs);
}

void ZeroBackend::run_micro_batches(MicroBatchRunner& runner) {
  if (pipe_)  // the schedule's backwards accumulate (stage 2: and reduce); step() reduces the rest
    return pipe_->run(runner, accumulation_, micro_, [this](const at::Tensor& loss, const MicroStep& m) { backward(loss, m); });
  if (stage_ != 3) return Backend::run_micro_batches(runner);
  tracing_ = !traced_;
  in_step_ = true;
  cursor_ = 0;
  fetch_unit(root_);  // embeddings, final norm, heads: used before and after the layers
  Backend::run_micro_batches(runner);
  traced_ = true;
  tracing_ = in_step_ = false;
  for (size_t u = 0; u < units_.size(); ++u) release_unit(u);  // the partitions only, between steps
}

void ZeroBackend::begin_eval() { hold_all(); }
void ZeroBackend::end_eval() { let_go_all(); }

// Phase 2: per group one flat buffer the parameters become views of, padded and split into
// partitions; this rank's master weights, moments and gradient for its partition; the
// optimizer over them.
void ZeroBackend::build_partitions(const OptimizerConfig& o, const std::vector<ParamGroup>& split) {
  const at::ScalarType dtype = params_.front().scalar_type();
  const bool half = dtype == at::kBFloat16 || dtype == at::kHalf;
  PT_INPUT_CHECK(dtype == at::kFloat || half, "env_type deepspeed: parameters of dtype ", c10::toString(dtype),
                 " are not supported (float, bfloat16, half)");
  const auto cpu = torch::TensorOptions().dtype(torch::kFloat).device(torch::kCPU);
  const auto dev = torch::TensorOptions().dtype(dtype).device(ctx_.device);
  const auto opt_dev = torch::TensorOptions().dtype(torch::kFloat).device(offload_ ? c10::Device(c10::kCPU) : ctx_.device);
  const bool pin = pin_memory_ && ctx_.device.is_cuda();
  const bool q8 = lower(o.type) == "adam8bit" || lower(o.type) == "adamw8bit";
  PT_INPUT_CHECK(!q8 || !opt_dev.device().is_cuda(), "optimizer.type ", o.type,
                 " keeps its 8-bit state and steps in CPU memory: with parameters on ", ctx_.device,
                 " set zero_optimization.offload_optimizer (device cpu)");

  std::vector<PartitionAdam::Slot> slots;
  torch::NoGradGuard no_grad;
  for (size_t g = 0; g < split.size(); ++g) {
    std::vector<std::string> names;
    std::vector<std::vector<int64_t>> shapes;
    for (const auto& [n, p] : split[g].params) {
      names.push_back(n);
      shapes.push_back(p.sizes().vec());
    }
    layouts_.push_back(make_zero_layout(names, shapes, owners_));
    const ZeroLayout& l = layouts_.back();
    auto grp = std::make_unique<Group>();
    grp->index = g;
    grp->weight_decay = split[g].weight_decay;
    grp->flat = torch::zeros({l.padded}, dev);
    if (stage_ <= 1) grp->grad_full = torch::zeros({l.padded}, dev);
    for (size_t e = 0; e < l.entries.size(); ++e) {
      at::Tensor p = split[g].params[e].second;
      const auto& en = l.entries[e];
      at::Tensor view = grp->flat.narrow(0, en.offset, en.numel);
      view.copy_(p.reshape({-1}));
      p.set_data(view.view(p.sizes()));  // the parameter now lives in the flat buffer
      if (stage_ <= 1) p.mutable_grad() = grp->grad_full.narrow(0, en.offset, en.numel).view(p.sizes());
      else p.mutable_grad() = at::Tensor();
    }
    if (partitioned(g)) {
      // Stage 3: the owned partition lives apart from the flat buffer, which comes and goes
      // (CPU memory with offload_param, pinned on CUDA).
      const auto part_dev = offload_param_ ? c10::Device(c10::kCPU) : ctx_.device;
      grp->flat_part = grp->flat.narrow(0, l.begin_of(owner_), l.part).to(part_dev, /*non_blocking=*/false, /*copy=*/true);
      if (offload_param_ && pin) grp->flat_part = grp->flat_part.pin_memory();
      grp->master_is_view = !half && grp->flat_part.device() == opt_dev.device();
    } else {
      grp->flat_part = grp->flat.narrow(0, l.begin_of(owner_), l.part);
      grp->master_is_view = !offload_ && !half;
    }
    grp->master = grp->master_is_view ? grp->flat_part : grp->flat_part.to(opt_dev, /*non_blocking=*/false, /*copy=*/true);
    if (offload_ && pin) grp->master = grp->master.pin_memory();
    if (q8) {
      grp->q8 = Moments8bit::make(o, l, l.owned(owner_), l.begin_of(owner_));
    } else {
      grp->exp_avg = torch::zeros({l.part}, opt_dev);
      grp->exp_avg_sq = torch::zeros({l.part}, opt_dev);
    }
    grp->grad = stage_ <= 1 ? grp->grad_full.narrow(0, l.begin_of(owner_), l.part)
                            : torch::zeros({l.part}, torch::TensorOptions().dtype(torch::kFloat).device(ctx_.device));
    if (offload_) {
      grp->master_grad = torch::zeros({l.part}, cpu);
      if (pin) grp->master_grad = grp->master_grad.pin_memory();
    } else {
      grp->master_grad = grp->grad.scalar_type() == torch::kFloat ? grp->grad : torch::zeros({l.part}, opt_dev);
    }
    if (offload_ && half && !grp->flat_part.is_cpu()) {
      grp->copy_out = torch::zeros({l.part}, torch::TensorOptions().dtype(torch::kShort));
      if (pin) grp->copy_out = grp->copy_out.pin_memory();
    }
    grp->master.mutable_grad() = grp->master_grad;
    masters_.push_back(grp->master);
    slots.push_back(PartitionAdam::Slot{grp->master, grp->exp_avg, grp->exp_avg_sq, grp->flat_part, grp->copy_out,
                                        grp->master_is_view, grp->weight_decay, grp->q8});
    groups_.push_back(std::move(grp));
  }
  optimizer_ = std::make_unique<PartitionAdam>(o, std::move(slots));
  if (stage_ == 3) {
    for (size_t g = 0; g < groups_.size(); ++g) {
      units_[unit_of_group_[g]]->numel += layouts_[g].padded;
      if (!partitioned(g)) continue;
      gathered_bytes_ += groups_[g]->flat.numel() * static_cast<int64_t>(groups_[g]->flat.element_size());
      live_elements_ += layouts_[g].padded;
    }
    for (size_t u = 0; u < units_.size(); ++u) release_unit(u);  // every rank keeps only its partitions
    layer_params_ = std::make_shared<ZeroLayerParams>(alive_);
    for (const auto& [layer, u] : unit_of_layer_) set_layer_params(*layer, layer_params_);
  }

}

// Phase 3: the gradient buckets, stage 2's reduce buffers and the hooks that launch them.
void ZeroBackend::build_buckets() {
  const auto dev = torch::TensorOptions().dtype(params_.front().scalar_type()).device(ctx_.device);
  // Buckets in reverse registration order (roughly the order backward produces gradients),
  // about reduce_bucket_size elements each. Within a group, reverse registration order walks
  // its entries downward one by one, so each bucket covers one contiguous range per group.
  bucket_of_.assign(params_.size(), 0);
  for (size_t k = params_.size(); k-- > 0;) {
    if (buckets_.empty() || buckets_.back()->numel >= reduce_bucket_) {
      buckets_.push_back(std::make_unique<Bucket>());
      buckets_.back()->ranges.assign(groups_.size(), {0, 0});
    }
    Bucket& b = *buckets_.back();
    const auto& en = layouts_[group_of_[k]].entries[entry_of_[k]];
    auto& r = b.ranges[group_of_[k]];
    if (r.first == r.second) r = {en.offset, en.offset + en.numel};
    else r.first = en.offset;  // entries come downward and adjacent
    b.params.push_back(k);
    b.numel += en.numel;
    bucket_of_[k] = buckets_.size() - 1;
  }
  int64_t largest = 0;
  for (auto& b : buckets_) {
    int64_t off = 0;
    for (const auto& r : b->ranges) {
      b->staging_offset.push_back(off);
      off += r.second - r.first;
    }
    largest = std::max(largest, b->numel);
  }
  ready_.assign(params_.size(), 0);
  late_.assign(buckets_.size(), 0);
  if (stage_ >= 2) {
    // One reduce buffer, two when reductions overlap backward (one fills while one is reduced).
    for (int s = 0; s < (overlap_ ? 2 : 1); ++s) staging_.push_back(torch::zeros({largest}, dev));
    flight_.resize(staging_.size());
    for (size_t k = 0; k < params_.size(); ++k) {
      auto acc = torch::autograd::impl::grad_accumulator(params_[k]);
      acc->add_post_hook(std::make_unique<ZeroGradHook>(alive_, k));
      // A variable holds its AccumulateGrad node weakly: unheld, the next forward would make a
      // new node without the hook (and no bucket would be reduced before backward ended).
      accumulators_.push_back(std::move(acc));
    }
  } else {
    flight_.resize(buckets_.size());
  }
}

void ZeroBackend::build_norm_views() {
  if (!tp_) return;
  torch::NoGradGuard no_grad;
  for (const auto& g : groups_) {
    const ZeroLayout& l = layouts_[g->index];
    const int64_t base = l.begin_of(owner_);
    for (const auto& p : l.owned(owner_)) {
      if (!tp_->counts_toward_norm(l.entries[p.entry].name)) continue;
      // A holder whose gradient is the piece of the partition's gradient the optimizer reads.
      at::Tensor holder = g->master.detach().narrow(0, p.flat_begin - base, p.length);
      holder.mutable_grad() = g->master_grad.narrow(0, p.flat_begin - base, p.length);
      norm_views_.push_back(holder);
    }
  }
}

void ZeroBackend::grad_ready(size_t param) {
  if (!armed_) return;
  if (ready_[param]) {
    // A second accumulation in the same backward: a shared parameter under activation
    // checkpointing (ALBERT's layers) gets one per checkpointed block. If its bucket is already
    // reduced, the rest is reduced again after backward (reductions add up).
    if (bucket_of_[param] < next_launch_) late_[bucket_of_[param]] = 1;
    return;
  }
  ready_[param] = 1;
  --buckets_[bucket_of_[param]]->pending;
  if (stage_ == 3) {  // a layer whose gradients are all in: its backward is over, let it go
    Unit& unit = *units_[unit_of_param_[param]];
    if (--unit.pending == 0 && unit.layer != nullptr && !reused_soon(unit_of_param_[param])) release_unit(unit_of_param_[param]);
  }
  if (!overlap_) return;
  // Launch in bucket order only, so every rank issues the same collectives in the same order
  // whatever order its gradients arrive in.
  while (next_launch_ < buckets_.size() && buckets_[next_launch_]->pending == 0) launch(next_launch_++);
}

void ZeroBackend::launch_remaining() {
  while (next_launch_ < buckets_.size()) launch(next_launch_++);
}

void ZeroBackend::launch(size_t bi) {
  Bucket& b = *buckets_[bi];
  auto f = std::make_unique<InFlight>();
  at::Tensor staging;
  size_t slot = bi;
  if (stage_ >= 2) {
    slot = bi % staging_.size();
    drain(slot);
    staging = staging_[slot];
    torch::NoGradGuard no_grad;
    for (size_t k : b.params) {
      const size_t g = group_of_[k];
      const auto& en = layouts_[g].entries[entry_of_[k]];
      at::Tensor dst = staging.narrow(0, b.staging_offset[g] + en.offset - b.ranges[g].first, en.numel);
      at::Tensor& grad = params_[k].mutable_grad();
      if (grad.defined()) dst.copy_(grad.reshape({-1}));
      else dst.zero_();  // no gradient this micro-step (DeepSpeed's ignore_unused_parameters)
      grad = at::Tensor();  // freed: only the owned partition is kept
    }
    f->staging = staging;
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    const int64_t lo = b.ranges[g].first, hi = b.ranges[g].second;
    if (lo == hi) continue;
    const ZeroLayout& l = layouts_[g];
    // The source of the range: the flat gradient (stage 0/1) or the reduce buffer (stage 2).
    auto source = [&](int64_t a, int64_t n) {
      return stage_ >= 2 ? staging.narrow(0, b.staging_offset[g] + a - lo, n) : groups_[g]->grad_full.narrow(0, a, n);
    };
    if (stage_ == 0) {
      at::Tensor t = source(lo, hi - lo);
      f->works.push_back(comm_->all_reduce_async(t, ReduceOp::kSum));
      continue;
    }
    for (int64_t r = lo / l.part; r < owners_ && l.begin_of(r) < hi; ++r) {
      const int64_t a = std::max(lo, l.begin_of(r)), e = std::min(hi, l.begin_of(r) + l.part);
      if (e <= a) continue;
      at::Tensor t = source(a, e - a);
      f->works.push_back(comm_->reduce_async(t, static_cast<int>(r), ReduceOp::kSum));
      if (r == owner_ && stage_ >= 2)
        f->mine.push_back(InFlight::Mine{g, b.staging_offset[g] + a - lo, a - l.begin_of(r), e - a});
    }
  }
  flight_[slot] = std::move(f);
}

void ZeroBackend::drain(size_t slot) {
  auto& f = flight_[slot];
  if (!f) return;
  for (auto& w : f->works) w->wait();
  torch::NoGradGuard no_grad;
  for (const auto& m : f->mine)
    groups_[m.group]->grad.narrow(0, m.part_offset, m.length).add_(f->staging.narrow(0, m.staging_offset, m.length));
  f.reset();
}

void ZeroBackend::backward(const at::Tensor& loss, const MicroStep& m) {
  if (stage_ >= 2) {  // every micro-step reduces its gradients into their owners' partitions
    std::fill(ready_.begin(), ready_.end(), 0);
    for (auto& b : buckets_) b->pending = b->params.size();
    for (auto& u : units_) u->pending = u->params;
    next_launch_ = 0;
    std::fill(late_.begin(), late_.end(), 0);
    armed_ = true;
    loss.backward();
    armed_ = false;
    launch_remaining();
    // Buckets that received gradients after they were reduced: reduce what came late (the
    // same buckets on every rank: which parameters accumulate twice is the model's structure).
    for (size_t b = 0; b < buckets_.size(); ++b)
      if (late_[b]) launch(b);
    // Layers with a parameter that got no gradient (unused in this micro-step) are let go now,
    // unless asked again soon (a prefetch for the next micro-batch is one).
    for (size_t u = 0; u < units_.size(); ++u)
      if (units_[u]->layer != nullptr && units_[u]->inflight.empty() && !reused_soon(u)) release_unit(u);
    return;
  }
  loss.backward();  // stage 0/1: accumulates into the flat gradient
  if (m.sync)
    for (size_t b = 0; b < buckets_.size(); ++b) launch(b);
}

void ZeroBackend::broadcast_partitions(size_t group, std::vector<std::unique_ptr<CommWork>>& works) {
  Group& g = *groups_[group];
  const ZeroLayout& l = layouts_[group];
  torch::NoGradGuard no_grad;
  at::Tensor flat = g.flat;
  if (partitioned(group)) {
    // Stage 3: the owned partition lives apart; it is written in through an alias with a
    // version counter of its own, so the parameters (views of the flat buffer) keep theirs and
    // what autograd saved of them in forward stays valid for the backward after this gather.
    flat = at::from_blob(g.flat.data_ptr(), {l.padded}, g.flat.options());
    flat.narrow(0, l.begin_of(owner_), l.part).copy_(g.flat_part);
  }
  for (int64_t r = 0; r < owners_; ++r)
    for (int64_t c = 0; c < l.part; c += allgather_bucket_) {
      at::Tensor t = flat.narrow(0, l.begin_of(r) + c, std::min(allgather_bucket_, l.part - c));
      works.push_back(comm_->broadcast_async(t, static_cast<int>(r)));
    }
}

void ZeroBackend::gather_params() {
  if (owners_ == 1) return;
  std::vector<std::unique_ptr<CommWork>> works;
  for (size_t g = 0; g < groups_.size(); ++g)
    // Stage 3: a unit let go is gathered when used next; one held (eval, export) now.
    if (!partitioned(g) || units_[unit_of_group_[g]]->gathered) broadcast_partitions(g, works);
  for (auto& w : works) w->wait();
}

StepResult ZeroBackend::step(const StepRequest& request, int64_t step) {
  if (pipe_ && stage_ <= 1)  // a pipeline's backwards never sync: stages 0-1 reduce the accumulated gradients now
    for (size_t b = 0; b < buckets_.size(); ++b) launch(b);
  for (size_t s = 0; s < flight_.size(); ++s) drain(s);
  torch::NoGradGuard no_grad;
  const double dp = static_cast<double>(ctx_.dp_size);
  for (auto& g : groups_) {
    g->grad.div_(dp);  // the sum over the data-parallel ranks -> their mean
    if (!g->master_grad.is_same(g->grad)) g->master_grad.copy_(g->grad);  // to CPU memory / fp32
  }
  SquaredNormReducer reduce;
  if (tp_) reduce = [this](double sq) { return sum_over_ranks(stage_grid(), ctx_.device, sq); };  // parts over TP, partitions over DP
  else if (owners_ > 1) reduce = [this](double sq) { return sum_over_ranks(*comm_, ctx_.device, sq); };
  if (pipe_) {  // and the stages' parameters over the pipeline
    SquaredNormReducer within = reduce;
    reduce = [this, within](double sq) { return pipe_->sum(within ? within(sq) : sq); };
  }
  const UpdateOutcome u =
      apply_update(masters_, *optimizer_, update_options(request, clip_), reduce, tp_ ? &norm_views_ : nullptr);
  if (u.applied) gather_params();
  for (auto& g : groups_) (stage_ <= 1 ? g->grad_full : g->grad).zero_();
  if (pipe_) pipe_->after_step();
  return step_result(u, step, global_batch_);
}

double ZeroBackend::reduce_metric(double local_value) {
  const double v = mean_over_ranks(*comm_, ctx_.device, local_value);
  return pipe_ ? pipe_->from_last(v) : v;  // a pipeline's losses are its last stage's
}

std::string ZeroBackend::share(const std::string& value) { return share_from_rank0(world(), ctx_.device, value); }

NamedTensors ZeroBackend::full_state(torch::nn::Module& model) {
  hold_all();  // stage 3: every layer gathered for the copy
  NamedTensors state = Backend::full_state(model);
  if (stage_ == 3)
    for (auto& [name, t] : state) t = t.detach().clone();  // the gathered buffers are let go below
  let_go_all();
  if (pipe_) state = pipe_->own(state);
  if (tp_) tp_->gather(state);
  if (pipe_) state = pipe_->gather(std::move(state));
  return state;
}

void ZeroBackend::release_model(torch::nn::Module& model) {
  if (stage_ == 3) {  // whole again on every rank, for good
    hold_all();
    released_model_ = true;
  }
  if (pipe_) pipe_->release(model);  // every stage's parameters on every stage, then whole TP parts
  if (tp_) tp_->release(model);
}

void ZeroBackend::load_full_state(torch::nn::Module& model, const NamedTensors& state, const std::string& origin) {
  hold_all();
  NamedTensors mine = tp_ ? tp_->slice(state, origin) : state;
  if (pipe_) mine = pipe_->select(mine);
  Backend::load_full_state(model, mine, origin);
  torch::NoGradGuard no_grad;
  for (auto& g : groups_) {
    if (partitioned(g->index)) g->flat_part.copy_(g->flat.narrow(0, layouts_[g->index].begin_of(owner_), layouts_[g->index].part));
    if (!g->master_is_view) g->master.copy_(g->flat_part);
  }
  let_go_all();
}

std::vector<std::string> ZeroBackend::runs_description() const {
  std::vector<std::string> out;
  for (const auto& g : groups_) out.push_back(g->q8.describe());
  return out;
}

ZeroMemory ZeroBackend::memory() const {
  ZeroMemory m;
  auto bytes = [](const at::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; };
  for (const auto& g : groups_) {
    m.params += partitioned(g->index) ? bytes(g->flat_part) : bytes(g->flat);
    if (!g->master_is_view) m.master += bytes(g->master);
    m.optimizer_state += bytes(g->exp_avg) + bytes(g->exp_avg_sq) + g->q8.bytes();
    m.gradients += stage_ <= 1 ? bytes(g->grad_full) : bytes(g->grad);
    if (offload_) m.host_copies += bytes(g->master_grad) + bytes(g->copy_out);
    else if (!g->master_grad.is_same(g->grad)) m.gradients += bytes(g->master_grad);
  }
  for (const auto& s : staging_) m.reduce_buffers += bytes(s);
  m.gathered_params = gathered_bytes_;
  m.gathered_params_peak = gathered_bytes_peak_;
  return m;
}

ZeroBackend::OwnedState ZeroBackend::owned_state() const {
  OwnedState out;
  std::vector<at::Tensor> master, m, v;
  for (const auto& g : groups_) {
    const ZeroLayout& l = layouts_[g->index];
    const int64_t base = l.begin_of(owner_);
    // 8-bit moments: dequantized to fp32, so the checkpoint's pieces load on any grid.
    const at::Tensor exp_avg = g->q8.defined() ? g->q8.dequantized("exp_avg", l.part) : g->exp_avg;
    const at::Tensor exp_avg_sq = g->q8.defined() ? g->q8.dequantized("exp_avg_sq", l.part) : g->exp_avg_sq;
    for (const auto& p : l.owned(owner_)) {
      out.names.push_back(l.entries[p.entry].name);
      out.shapes.push_back(l.entries[p.entry].shape);
      out.begins.push_back(p.param_begin);
      out.lengths.push_back(p.length);
      master.push_back(g->master.narrow(0, p.flat_begin - base, p.length).to(torch::kCPU, torch::kFloat));
      m.push_back(exp_avg.narrow(0, p.flat_begin - base, p.length).cpu());
      v.push_back(exp_avg_sq.narrow(0, p.flat_begin - base, p.length).cpu());
    }
  }
  auto join = [](const std::vector<at::Tensor>& parts) {
    return parts.empty() ? torch::zeros({0}, torch::kFloat) : torch::cat(parts);
  };
  out.master = join(master);
  out.exp_avg = join(m);
  out.exp_avg_sq = join(v);
  out.step = static_cast<const PartitionAdam&>(*optimizer_).step_count();
  return out;
}

// The shard: this rank's owned slices in the universal layout (universal_state.h): each
// parameter by its full name and whole shape, its TP part, the range of that part, and the
// master weights and moments. Nothing in it depends on the grid that wrote it.
void ZeroBackend::save_shard(torch::serialize::OutputArchive& archive) {
  const OwnedState s = owned_state();
  std::vector<StatePiece> pieces;
  int64_t off = 0;
  for (size_t i = 0; i < s.names.size(); ++i) {
    StatePiece p;
    p.name = s.names[i];
    p.whole_shape = tp_ ? tp_->whole_shape(p.name, s.shapes[i]) : s.shapes[i];
    if (tp_) p.split = tp_->split_of(p.name);
    if (p.split.parts == 1 && ctx_.tp_rank != 0) {  // a replicated parameter: every TP rank holds the same state, rank 0 saves it
      off += s.lengths[i];
      continue;
    }
    p.begin = s.begins[i];
    p.length = s.lengths[i];
    p.step = s.step;
    p.stats = {{"master", s.master.narrow(0, off, p.length)},
               {"exp_avg", s.exp_avg.narrow(0, off, p.length)},
               {"exp_avg_sq", s.exp_avg_sq.narrow(0, off, p.length)}};
    off += p.length;
    pieces.push_back(std::move(p));
  }
  write_state_pieces(archive, pieces);
  if (groups_.front()->q8.defined()) {
    // The pieces hold the 8-bit moments dequantized (any grid loads them); the partitions' own
    // codes and block scales make the resume on this grid exact.
    archive.write("zero_8bit_layout", c10::IValue(partition_fingerprint(layouts_, owners_, owner_, ctx_, runs_description())));
    for (const auto& g : groups_)
      for (size_t r = 0; r < g->q8.runs.size(); ++r) {
        const auto& run = g->q8.runs[r];
        if (run.full) continue;  // its fp32 moments are the pieces' own
        const std::string k = "zero_8bit_g" + std::to_string(g->index) + "_r" + std::to_string(r) + "_";
        archive.write(k + "exp_avg_codes", run.q8.exp_avg);
        archive.write(k + "exp_avg_absmax", run.q8.exp_avg_absmax);
        archive.write(k + "exp_avg_sq_codes", run.q8.exp_avg_sq);
        archive.write(k + "exp_avg_sq_absmax", run.q8.exp_avg_sq_absmax);
      }
  }
  if (tp_) tp_->save_rng(archive);
}

// Any checkpoint: every parameter's state put back together whole (whatever grid, stage or
// env_type saved it), then this rank's TP part and ZeRO partition taken from it.
void ZeroBackend::load_shards(ShardReader& reader) {
  PT_INPUT_CHECK(has_universal_state(reader), reader.origin(), ": optimizer state saved by env_type '",
                 reader.env_type(), "' in its own format (not the universal layout); resume with env_type '",
                 reader.env_type(), "', or start from the model weights alone (--init_from)");
  const UniversalState state = read_universal_state(reader);
  if (tp_) tp_->load_rng(reader);  // this TP rank's dropout stream
  std::set<std::string> mine;
  torch::NoGradGuard no_grad;
  for (auto& g : groups_) {
    const ZeroLayout& l = layouts_[g->index];
    const int64_t base = l.begin_of(owner_);
    // The moments being restored: the partition's own, or (8-bit) fp32 ones quantized after.
    at::Tensor exp_avg = g->q8.defined() ? torch::zeros({l.part}, torch::kFloat) : g->exp_avg;
    at::Tensor exp_avg_sq = g->q8.defined() ? torch::zeros({l.part}, torch::kFloat) : g->exp_avg_sq;
    for (const auto& en : l.entries) mine.insert(en.name);
    for (const auto& p : l.owned(owner_)) {
      const auto& en = l.entries[p.entry];
      const ParamState* ps = state.find(en.name);
      PT_INPUT_CHECK(ps, reader.origin(), ": no optimizer state for parameter '", en.name, "' (saved from another model?)");
      const TpShardSpec* spec = tp_ ? tp_->spec(en.name) : nullptr;
      const std::vector<int64_t> whole = tp_ ? tp_->whole_shape(en.name, en.shape) : en.shape;
      PT_INPUT_CHECK(ps->shape == whole, reader.origin(), ": parameter '", en.name, "' saved with shape ",
                     c10::IntArrayRef(ps->shape), ", the model has ", c10::IntArrayRef(whole));
      auto take = [&](const char* stat, at::Tensor& dst) {
        at::Tensor src = ps->local(stat, spec, ctx_.tp_rank, ctx_.tp_size);
        if (!src.defined()) return false;
        dst.narrow(0, p.flat_begin - base, p.length).copy_(src.narrow(0, p.param_begin, p.length));
        return true;
      };
      take("master", g->master);  // absent when saved by a whole-parameter optimizer: the model file's weights stay
      if (!take("exp_avg", exp_avg)) exp_avg.narrow(0, p.flat_begin - base, p.length).zero_();
      if (!take("exp_avg_sq", exp_avg_sq)) exp_avg_sq.narrow(0, p.flat_begin - base, p.length).zero_();
    }
    if (g->q8.defined()) {
      g->q8.assign("exp_avg", exp_avg);
      g->q8.assign("exp_avg_sq", exp_avg_sq);
    }
  }
  // Saved from this partition on this grid (by this rank, or at stage 0 by the dp rank 0 of
  // this TP rank): its raw 8-bit state, exactly, on every rank that holds the partition.
  const std::string fingerprint =
      groups_.front()->q8.defined() ? partition_fingerprint(layouts_, owners_, owner_, ctx_, runs_description()) : std::string();
  bool exact = fingerprint.empty();
  std::vector<int64_t> candidates = {ctx_.rank};
  for (int64_t r = 0; r < reader.saved_world_size(); ++r)
    if (r != ctx_.rank) candidates.push_back(r);
  for (int64_t r : candidates) {
    if (exact || !reader.has_shard(r)) continue;
    reader.read_shard(r, [&](torch::serialize::InputArchive& a, const std::string& origin) {
      c10::IValue f;
      if (!a.try_read("zero_8bit_layout", f) || !f.isString() || f.toStringRef() != fingerprint) return;
      exact = true;
      for (auto& g : groups_)
        for (size_t r = 0; r < g->q8.runs.size(); ++r) {
          QuantizedMoments& q = g->q8.runs[r].q8;
          if (g->q8.runs[r].full) continue;
          const std::string k = "zero_8bit_g" + std::to_string(g->index) + "_r" + std::to_string(r) + "_";
          std::map<std::string, at::Tensor> saved;
          for (const char* key : {"exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax"}) {
            at::Tensor t;
            PT_INPUT_CHECK(a.try_read(k + key, t), origin, ": 8-bit optimizer state without '", k + key, "'");
            saved[key] = t;
          }
          PT_INPUT_CHECK(saved["exp_avg_codes"].numel() == q.numel() && saved["exp_avg_sq_codes"].numel() == q.numel() &&
                             saved["exp_avg_absmax"].numel() == q.exp_avg_absmax.numel() &&
                             saved["exp_avg_sq_absmax"].numel() == q.exp_avg_sq_absmax.numel(),
                         origin, ": 8-bit optimizer state of group ", g->index, " does not fit its partition");
          q.exp_avg.copy_(saved["exp_avg_codes"].reshape({-1}));
          q.exp_avg_absmax.copy_(saved["exp_avg_absmax"].reshape({-1}));
          q.exp_avg_sq.copy_(saved["exp_avg_sq_codes"].reshape({-1}));
          q.exp_avg_sq_absmax.copy_(saved["exp_avg_sq_absmax"].reshape({-1}));
        }
    });
  }
  for (const auto& [name, ps] : state.params)
    PT_INPUT_CHECK(mine.count(name) || (pipe_ && (pipe_->dropped(name) || pipe_->mirrors(name))), reader.origin(),
                   ": optimizer state for parameter '", name, "', which this model does not train");
  static_cast<PartitionAdam&>(*optimizer_).set_step_count(state.step);
  for (auto& g : groups_)
    if (!g->master_is_view) g->flat_part.copy_(g->master);
  gather_params();
}

}  // namespace polytrain
