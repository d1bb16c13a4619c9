// Gradients in flat buckets: the parameters' .grad tensors become views into a few flat
// buffers (reverse registration order, about `bucket_bytes` each, one dtype per bucket), and a
// post-hook on each parameter's gradient accumulator reports when a bucket's last gradient of
// an armed backward is in (PyTorch DDP's Reducer design, Li et al., VLDB 2020; picotron's
// bucket.py). What to do with a ready bucket (all-reduce for DDP, reduce-scatter for ZeRO
// stage 2) is the owner's callback; this class does no communication.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace polytrain {

class GradBuckets {
 public:
  struct Bucket {
    at::Tensor buffer;           ///< flat gradients of its parameters
    std::vector<size_t> params;  ///< indices into the parameter list
    size_t pending = 0;          ///< gradients not yet in during the armed backward
  };

  /// Builds the buckets over `params` (names for messages) and hooks every parameter.
  /// `on_ready(b)` runs on the autograd thread when bucket b is complete in an armed backward.
  GradBuckets(std::vector<at::Tensor> params, std::vector<std::string> names, int64_t bucket_bytes,
              std::function<void(size_t)> on_ready);
  ~GradBuckets();
  GradBuckets(const GradBuckets&) = delete;
  GradBuckets& operator=(const GradBuckets&) = delete;

  /// The next backward completes the global batch: track readiness and call on_ready.
  void arm();
  /// Whether the last arm() is still in effect (cleared by zero()).
  bool armed() const { return armed_; }
  size_t size() const { return buckets_.size(); }
  Bucket& bucket(size_t b) { return buckets_[b]; }
  /// Names of the parameters of bucket b that received no gradient in the armed backward.
  std::vector<std::string> missing(size_t b) const;
  /// Zeroes every buffer in place (never set_to_none: .grad must stay a bucket view) and disarms
  /// (the first armed backward's accumulation counts are learned here).
  void zero();
  /// Forgets the learned accumulation counts: the next armed backward only counts again (fault
  /// tolerance: a group with a fresh replacement in it, which has learned nothing yet, must issue
  /// its all-reduces in the same order on every rank).
  void relearn() { learned_ = false; }
  /// Called by the hook of parameter `index` once its gradient is accumulated.
  void grad_ready(size_t index);
  /// A parameter whose gradient was accumulated more often in the last armed backward than
  /// in the first one after its bucket was reported ready ("" when none): the graph changed
  /// after the readiness counts were learned, and that bucket was communicated incomplete.
  const std::string& overfired() const { return overfired_; }

 private:
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::function<void(size_t)> on_ready_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;
  std::vector<char> ready_;
  // Accumulations per parameter in one backward: a shared parameter under activation
  // checkpointing (ALBERT's layers) gets one per checkpointed block, in nested backwards.
  // The first armed backward only counts them (no bucket is reported ready during it); later
  // ones report a bucket once all its counted accumulations are in (PyTorch DDP's
  // static_graph does the same).
  std::vector<int> expected_, fired_;
  bool learned_ = false;
  std::string overfired_;
  bool armed_ = false;
  std::vector<std::shared_ptr<void>> accumulators_;  ///< keep the hooked nodes alive
};

}  // namespace polytrain
