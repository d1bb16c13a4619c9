// The layers models build their projections, embeddings and attention dropouts from. By default
// each is a plain layer (torch::nn's math, parameter names and initialisation). The
// tensor-parallel backend (env_type deepspeed+mpu) splits them in place by a plan the model
// declares (TensorParallelPlanned, as transformers' `base_model_tp_plan` and torchtitan's
// parallelize plans name modules): it narrows their weights and sets their TpSlot, and the same
// forward then runs Megatron-LM's layer (Shoeybi et al. 2019, section 3):
//   column (ColumnParallelLinear): y_r = f(x) W_r^T + b_r   (gather_output: all-gather the y_r)
//   row    (RowParallelLinear):    y   = g(x_r W_r^T) + b    (bias added once, after the reduce)
//   vocab  (VocabParallelEmbedding): rows [r V/p, (r+1) V/p) of the (padded) vocabulary; ids
//          outside are looked up as 0 and zeroed, then g; as an LM head: local logits and a
//          vocab-parallel cross entropy.
// f and g are Megatron's conjugate operators (identity / all-reduce), implemented over the
// tensor-parallel communicator in parallel/tensor_parallel; this header knows no engine, so
// models stay free of parallel code: they read local sizes from their weights (view(b, l, -1,
// head_dim), never the config's head count).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

namespace polytrain {

enum class TpStyle {
  kReplicated,  ///< the whole layer on every rank (a plain layer)
  kColumn,      ///< output features split (Megatron's ColumnParallelLinear)
  kRow,         ///< input features split (RowParallelLinear)
  kVocab,       ///< vocabulary rows split, padded to a multiple of p (VocabParallelEmbedding, LM head)
  kHeads,       ///< a per-head table split by its last dim, no communication (T5's relative attention bias)
};

/// The tensor-parallel group as layers see it (parallel/tensor_parallel/tp_region.h implements it
/// over a Communicator). Every function is differentiable.
class TensorParallelRegion {
 public:
  virtual ~TensorParallelRegion() = default;
  virtual int64_t rank() const = 0;
  virtual int64_t size() const = 0;
  /// Megatron's f: identity forward, all-reduce (sum) of the gradient backward.
  virtual at::Tensor copy_to(const at::Tensor& x) = 0;
  /// Megatron's g: all-reduce (sum) forward, identity backward.
  virtual at::Tensor reduce_from(const at::Tensor& x) = 0;
  /// Every rank's x concatenated along the last dim (rank order); backward keeps this rank's slice.
  virtual at::Tensor gather_last_dim(const at::Tensor& x) = 0;
  /// This rank's 1/p of the last dim; backward all-gathers.
  virtual at::Tensor scatter_last_dim(const at::Tensor& x) = 0;
  /// Mean cross entropy over rows whose label is not ignore_index, the vocabulary split by rows:
  /// local_logits [N, Vl] are vocabulary ids [begin, begin + valid) (columns from valid on are
  /// padding and never predicted), labels [N] are global ids. Max, target logit and sum of
  /// exponentials are all-reduced; the gradient is softmax minus one-hot on the owning rank.
  virtual at::Tensor vocab_cross_entropy(const at::Tensor& local_logits, const at::Tensor& labels, int64_t begin,
                                         int64_t valid, int64_t ignore_index) = 0;
};

/// How a layer is split (set by the tensor-parallel plan; the defaults are a plain layer).
struct TpSlot {
  TpStyle style = TpStyle::kReplicated;
  std::shared_ptr<TensorParallelRegion> region;
  /// Column: the weight's output features are this many equal blocks, each split on its own
  /// (3 for GPT-2's fused q|k|v: rank r keeps its heads of q, of k and of v).
  int64_t blocks = 1;
  bool gather_output = false;     ///< column: all-gather the output (Megatron's gather_output)
  bool input_is_parallel = true;  ///< row: the input arrives split (else it is scattered first)
  int64_t vocab_begin = 0;        ///< vocab: first vocabulary id of this rank's rows
  int64_t vocab_valid = 0;        ///< vocab: rows of this shard that are real (the rest: padding)
  int64_t vocab_size = 0;         ///< vocab: the whole, unpadded vocabulary
  bool sharded() const { return style != TpStyle::kReplicated && region != nullptr; }
};

/// A layer the plan can split: its weight, its bias (undefined when none), and which weight
/// dim holds the output features (0 for a Linear's [out, in], 1 for GPT-2's Conv1D [in, out]).
class TpShardable {
 public:
  virtual ~TpShardable() = default;
  virtual at::Tensor tp_weight() const = 0;
  virtual at::Tensor tp_bias() const { return at::Tensor(); }
  virtual int64_t tp_out_dim() const = 0;
  TpSlot tp;

 protected:
  /// Column: f(x); row with !input_is_parallel: this rank's slice of x; else x.
  at::Tensor tp_enter(const at::Tensor& x) const;
  /// Whether the layer's own bias must be left out of its matmul (row: added after the reduce).
  bool tp_bias_after() const { return tp.sharded() && tp.style == TpStyle::kRow; }
  /// Row: g(y) (+ bias); column with gather_output: all-gather; else y.
  at::Tensor tp_leave(const at::Tensor& y, const at::Tensor& bias) const;
};

/// torch::nn::Linear's math, names ("weight" [out, in], "bias" [out]) and initialisation.
struct LinearImpl : torch::nn::Module, TpShardable {
  LinearImpl(int64_t in_features, int64_t out_features, bool with_bias = true);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor tp_weight() const override { return weight; }
  at::Tensor tp_bias() const override { return bias; }
  int64_t tp_out_dim() const override { return 0; }
  at::Tensor weight, bias;
};
TORCH_MODULE(Linear);

/// torch::nn::Embedding's lookup, name ("weight" [num, dim]), padding_idx and initialisation.
struct EmbeddingImpl : torch::nn::Module, TpShardable {
  EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim, std::optional<int64_t> padding_idx = std::nullopt);
  at::Tensor forward(const at::Tensor& ids);
  at::Tensor tp_weight() const override { return weight; }
  int64_t tp_out_dim() const override { return 0; }
  at::Tensor weight;
  std::optional<int64_t> padding_idx;
};
TORCH_MODULE(Embedding);

/// Every model's dropout. On the CPU cpu_dropout (cpu_dropout.h: a counter-based mask on all
/// threads, regenerated in the backward); on a GPU ATen's dropout. The draw comes from the
/// default generator, or, inside a tensor-parallel region (attention probabilities of this
/// rank's heads), from the region's own generator (Megatron's model-parallel RNG stream) so
/// ranks do not share masks of different heads.
struct DropoutImpl : torch::nn::Module {
  explicit DropoutImpl(double p = 0.5);
  at::Tensor forward(const at::Tensor& x);
  double p;
  std::optional<at::Generator> generator;  ///< set by the tensor-parallel plan
};
TORCH_MODULE(Dropout);

/// Logits over the whole vocabulary of hidden [..., H] against an LM head's weight [V, H] and
/// bias [V] (or undefined): F::linear, or, vocabulary-split, f, the local logits, all-gathered
/// without the padding.
at::Tensor lm_logits(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias, const TpSlot& vocab);

/// The language-model loss without [N, V] logits: fused_linear_cross_entropy, or,
/// vocabulary-split, f, the local [N, V/p] logits and the vocab-parallel cross entropy. The
/// fused chunked kernel is not used when split: it would need three all-reduces per chunk of
/// rows, and the local logits are already 1/p of the full ones.
at::Tensor lm_loss(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                   const at::Tensor& labels, const TpSlot& vocab, int64_t ignore_index = -100);

/// One entry of a model's tensor-parallel plan.
struct TpPlanEntry {
  std::string pattern;  ///< module (or, for kVocab, also bare parameter) names: ECMAScript regex, whole-name match
  TpStyle style = TpStyle::kReplicated;
  int64_t blocks = 1;             ///< see TpSlot::blocks
  bool gather_output = false;
  bool input_is_parallel = true;
};

/// What a model declares so the tensor-parallel backend can split it.
struct TpPlan {
  std::string model;                  ///< for messages ("gpt2")
  std::vector<TpPlanEntry> layers;    ///< TpShardable modules (and kVocab bare parameters, split like the vocabulary)
  std::vector<std::string> region_dropouts;  ///< Dropout modules inside split regions: the region's generator
  /// Sizes that must be multiples of the tensor-parallel size, with the config key naming each.
  std::vector<std::pair<std::string, int64_t>> divisible;
};

/// Implemented by models that can be split by the tensor-parallel backend.
class TensorParallelPlanned {
 public:
  virtual ~TensorParallelPlanned() = default;
  virtual TpPlan tensor_parallel_plan() const = 0;
};

}  // namespace polytrain
