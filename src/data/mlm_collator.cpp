// MlmCollator: per-sample masking with keyed counter RNG streams, then padding into tensors.
// Each position p of a sample draws from its own CounterRng keyed on (sample key, p): draw 1
// decides selection, draw 2 the [MASK]/random/keep choice, later draws the random id. So a
// position's outcome never depends on how many draws other positions used.
#include "polytrain/data/mlm_collator.h"

#include <algorithm>
#include <utility>

#include <torch/torch.h>

#include "polytrain/common/error.h"
#include "polytrain/data/sample_order.h"

namespace polytrain {
namespace {

constexpr int64_t kIgnoreIndex = -100;  // torch cross_entropy's default ignore_index
constexpr uint64_t kMaskDomain = 0x6D6C6D6D61736B31ULL;  // "mlmmask1"

bool lookup(const std::vector<bool>& table, int64_t id) {
  return id >= 0 && static_cast<size_t>(id) < table.size() && table[static_cast<size_t>(id)];
}

void check_prob(double p, const char* key) {
  PT_INPUT_CHECK(p >= 0.0 && p <= 1.0, "data.", key, " must be in [0, 1], got ", p);
}

}  // namespace

MlmCollator::MlmCollator(const DataConfig& cfg, MlmSpecialIds ids,
                         std::vector<bool> is_continuation, std::vector<bool> is_special)
    : ids_(ids),
      mask_prob_(cfg.mask_prob),
      mask_token_prob_(1.0 - cfg.random_replace_prob - cfg.unmask_replace_prob),
      random_token_prob_(cfg.random_replace_prob),
      whole_word_(cfg.whole_word_mask),
      is_continuation_(std::move(is_continuation)),
      is_special_(std::move(is_special)) {
  check_prob(cfg.mask_prob, "mask_prob");
  check_prob(cfg.random_replace_prob, "random_replace_prob");
  check_prob(cfg.unmask_replace_prob, "unmask_replace_prob");
  PT_INPUT_CHECK(cfg.random_replace_prob + cfg.unmask_replace_prob <= 1.0 + 1e-12,
                 "data.random_replace_prob + data.unmask_replace_prob must be <= 1, got ",
                 cfg.random_replace_prob, " + ", cfg.unmask_replace_prob);
  PT_INPUT_CHECK(ids_.vocab_size > 0, "vocab_size must be positive, got ", ids_.vocab_size);
  PT_INPUT_CHECK(!whole_word_ || !is_continuation_.empty(),
                 "data.whole_word_mask needs the tokenizer's continuation (##) table");
  is_special_.resize(static_cast<size_t>(ids_.vocab_size), false);
  const std::pair<const char*, int64_t> named[] = {{"[PAD]", ids_.pad}, {"[CLS]", ids_.cls},
                                                   {"[SEP]", ids_.sep}, {"[MASK]", ids_.mask},
                                                   {"[UNK]", ids_.unk}};
  for (const auto& [name, id] : named) {
    PT_INPUT_CHECK(id >= 0 && id < ids_.vocab_size, "masked-LM needs ", name,
                   " in the vocabulary, got id ", id, " (vocab size ", ids_.vocab_size, ")");
    is_special_[static_cast<size_t>(id)] = true;
  }
  for (int64_t id = 0; id < ids_.vocab_size; ++id)
    if (!is_special_[static_cast<size_t>(id)]) replacement_ids_.push_back(id);
  PT_INPUT_CHECK(!replacement_ids_.empty() || cfg.random_replace_prob == 0.0,
                 "data.random_replace_prob > 0 but the vocabulary has no non-special token");
}

bool MlmCollator::special(int64_t id) const { return lookup(is_special_, id); }
bool MlmCollator::continuation(int64_t id) const { return lookup(is_continuation_, id); }

void MlmCollator::mask_sample(std::vector<int64_t>& ids, std::vector<int64_t>& labels,
                              int64_t global_index, int64_t epoch, uint64_t seed) const {
  labels.assign(ids.size(), kIgnoreIndex);
  const uint64_t key = mix_seed(seed, static_cast<uint64_t>(epoch),
                                static_cast<uint64_t>(global_index), kMaskDomain);
  Stats local;
  bool prev_candidate = false;  // whole-word: a ## piece continues only a candidate word
  bool word_selected = false;
  for (size_t p = 0; p < ids.size(); ++p) {
    const int64_t id = ids[p];
    PT_INPUT_CHECK(id >= 0 && id < ids_.vocab_size, "token id ", id, " at position ", p,
                   " of sample ", global_index, " outside the vocabulary [0, ",
                   ids_.vocab_size, ")");
    if (special(id)) {
      prev_candidate = false;
      continue;
    }
    ++local.candidates;
    CounterRng rng(mix_seed(key, p));
    const double u_select = rng.next_double();
    const double u_action = rng.next_double();
    bool selected;
    if (whole_word_) {
      // A word starts at a non-continuation piece, or at an orphan ## piece (block start,
      // after a special token); its decision is the draw of its first piece.
      if (!(prev_candidate && continuation(id))) word_selected = u_select < mask_prob_;
      selected = word_selected;
    } else {
      selected = u_select < mask_prob_;
    }
    prev_candidate = true;
    if (!selected) continue;
    ++local.masked;
    labels[p] = id;
    if (u_action < mask_token_prob_) {
      ids[p] = ids_.mask;
      ++local.replaced_mask;
    } else if (u_action < mask_token_prob_ + random_token_prob_) {
      ids[p] = replacement_ids_[rng.bounded(replacement_ids_.size())];
      ++local.replaced_random;
    } else {
      ++local.kept;
    }
  }
  if (stats_ != nullptr) {
    stats_->candidates += local.candidates;
    stats_->masked += local.masked;
    stats_->replaced_mask += local.replaced_mask;
    stats_->replaced_random += local.replaced_random;
    stats_->kept += local.kept;
  }
}

Batch MlmCollator::collate(const std::vector<const std::vector<int64_t>*>& samples,
                           const std::vector<int64_t>& global_indices, int64_t epoch,
                           uint64_t seed) const {
  PT_CHECK(!samples.empty(), "collate of an empty batch");
  PT_CHECK(samples.size() == global_indices.size(), samples.size(), " samples but ",
           global_indices.size(), " global indices");
  size_t max_len = 0;
  for (const auto* s : samples) {
    PT_CHECK(s != nullptr, "null sample");
    max_len = std::max(max_len, s->size());
  }
  const auto b = static_cast<int64_t>(samples.size());
  const auto l = static_cast<int64_t>(max_len);
  auto opts = torch::TensorOptions().dtype(torch::kLong);
  at::Tensor input_ids = torch::full({b, l}, ids_.pad, opts);
  at::Tensor attention = torch::zeros({b, l}, opts);
  at::Tensor labels = torch::full({b, l}, kIgnoreIndex, opts);
  int64_t* in_p = input_ids.data_ptr<int64_t>();
  int64_t* att_p = attention.data_ptr<int64_t>();
  int64_t* lab_p = labels.data_ptr<int64_t>();
  std::vector<int64_t> ids, labs;
  for (int64_t i = 0; i < b; ++i) {
    ids = *samples[i];
    mask_sample(ids, labs, global_indices[i], epoch, seed);
    std::copy(ids.begin(), ids.end(), in_p + i * l);
    std::copy(labs.begin(), labs.end(), lab_p + i * l);
    std::fill(att_p + i * l, att_p + i * l + static_cast<int64_t>(ids.size()), 1);
  }
  Batch batch;
  batch.set("input_ids", input_ids);
  batch.set("attention_mask", attention);
  batch.set("token_type_ids", torch::zeros({b, l}, opts));
  batch.set("labels", labels);
  return batch;
}

}  // namespace polytrain
