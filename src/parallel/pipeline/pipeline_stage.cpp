#include "polytrain/parallel/pipeline/pipeline_stage.h"

#include <dlfcn.h>
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <regex>
#include <unordered_map>
#include <unordered_set>

#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include "polytrain/checkpoint/checkpoint.h"
#include "polytrain/common/error.h"
#include "polytrain/models/activation_checkpoint.h"
#include "polytrain/parallel/comm/communicator.h"
#include "polytrain/parallel/comm/rank_ops.h"
#include "polytrain/parallel/pipeline/pp_schedule.h"

namespace polytrain {

using detail::cat;

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Tags: a message is a header and its tensors, at tag base + 0, (1 for a long header), 2 + i.
// Messages between two ranks with the same tag arrive in the order they were sent (MPI's
// non-overtaking rule; Gloo's pairs and NCCL keep it too), and both ends of a pipeline post them
// in the same order: each stage runs the schedule's forwards (and backwards) in one order of
// (micro-batch, chunk) that does not depend on the stage. So a purpose needs one tag range, not
// one per micro-batch, and the tags stay far below MPI's guaranteed bound of 32767.
constexpr int kMaxTensors = 62;
constexpr int64_t kHeader = 128;  // words of the first message (a carry's header fits easily)
constexpr int kForwardTag = 0;    // activations to the next chunk
constexpr int kBackwardTag = 64;  // their gradients back
constexpr int kEvalTag = 128;     // evaluation's activations
constexpr int kMirrorTag = 192;   // mirrors' gradients to their primary, new values back
constexpr int kGatherTag = 256;   // the model to stage 0: a count, then messages at kGatherTag + 64

// Bytes the allocator has handed out: tcmalloc's count when it is the process's allocator (it
// keeps glibc's mallinfo at zero), glibc's otherwise.
int64_t heap_in_use() {
  using Property = int (*)(const char*, size_t*);
  static const Property tcmalloc = reinterpret_cast<Property>(dlsym(RTLD_DEFAULT, "MallocExtension_GetNumericProperty"));
  size_t bytes = 0;
  if (tcmalloc && tcmalloc("generic.current_allocated_bytes", &bytes)) return static_cast<int64_t>(bytes);
  const struct mallinfo2 m = mallinfo2();
  return static_cast<int64_t>(m.uordblks + m.hblkhd);
}

// ZB-H1's split of one micro-batch's backward (Qi et al. 2024). B computes the gradients of the
// chunk's inputs only: given the received leaves as outputs, the autograd engine skips every
// product that only leads to a parameter. Before it, the graph is walked once: a node whose
// inputs lead both to the received activations and to parameters (a matmul with its weight, a
// LayerNorm, a bias add) gets a pre-hook that keeps the gradients B hands it. W then starts the
// engine at those nodes with those gradients and asks for the parameters' gradients only, so
// nothing of B is computed twice; the graph is kept between the two.
class SplitBackward {
 public:
  std::vector<at::Tensor> inputs(const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& grads,
                                 const std::vector<at::Tensor>& leaves) {
    using torch::autograd::impl::gradient_edge;
    for (size_t i = 0; i < roots.size(); ++i) {
      roots_.push_back(gradient_edge(roots[i]));
      grads_.push_back(grads[i]);
    }
    if (leaves.empty()) return {};  // the first chunk: all of it is W
    torch::autograd::edge_list outputs;
    std::unordered_set<const Node*> received;
    for (const auto& t : leaves) {
      outputs.push_back(gradient_edge(t));
      received.insert(outputs.back().function.get());
    }
    auto& engine = torch::autograd::Engine::get_default_engine();
    if (!mark(received)) {
      // A parameter used twice in this chunk (a shared layer applied twice, an embedding tied to a
      // head on the same stage): a W run from its upper use would redo the lower one. This
      // micro-batch's backward stays whole, in B.
      engine.execute(roots_, grads_, false, false, /*accumulate_grad=*/true);
      roots_.clear(), grads_.clear(), hooked_.clear();
      std::vector<at::Tensor> out;
      for (const auto& t : leaves) out.push_back(t.grad());
      return out;
    }
    split_ = true;
    return engine.execute(roots_, grads_, /*keep_graph=*/true, /*create_graph=*/false, /*accumulate_grad=*/false,
                          outputs);
  }
  /// Whether B ran as the input gradients only (false: the whole backward runs in W or ran in B).
  bool split() const { return split_; }
  void weights() {
    auto& engine = torch::autograd::Engine::get_default_engine();
    if (!split_) {  // a plain backward into the parameters
      if (!roots_.empty()) engine.execute(roots_, grads_, false, false, /*accumulate_grad=*/true);
    } else {
      // One engine run per node, asking only for its own parameters: the activation edge it also
      // has leads to other parameters, which another run's output list would make the engine
      // recompute the whole chain below for.
      for (auto& h : hooked_) {
        if (h.params.empty()) continue;
        PT_CHECK(h.grads->size() == h.node->num_inputs(), "ZB-H1: node ", h.node->name(), " was not reached by B");
        torch::autograd::edge_list roots;
        for (uint32_t k = 0; k < h.node->num_inputs(); ++k) roots.emplace_back(h.node, k);
        engine.execute(roots, *h.grads, /*keep_graph=*/true, false, /*accumulate_grad=*/true, h.params);
      }
    }
    roots_.clear(), grads_.clear(), hooked_.clear();
  }

 private:
  using Node = torch::autograd::Node;
  struct Keep : torch::autograd::FunctionPreHook {
    explicit Keep(std::shared_ptr<torch::autograd::variable_list> into) : into_(std::move(into)) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
      *into_ = grads;
      return grads;
    }
    std::shared_ptr<torch::autograd::variable_list> into_;
  };
  // Post-order walk from the roots: a node is "parameters only" when every edge it has leads to
  // a parameter's accumulator (not a received activation's) or to more of the same; a node that
  // is not, with an edge into such a part, is where W starts. False when some parameter is
  // reached from two such nodes (used twice).
  bool mark(const std::unordered_set<const Node*>& received) {
    std::unordered_map<const Node*, int> state;  // 1: visiting, 2: parameters only, 3: reaches an input
    std::vector<std::pair<std::shared_ptr<Node>, size_t>> stack;
    for (const auto& e : roots_)
      if (e.function) stack.emplace_back(e.function, 0);
    while (!stack.empty()) {
      auto& [node, next] = stack.back();
      const Node* raw = node.get();
      if (next == 0) {
        if (state.count(raw) && state[raw] != 1) {
          stack.pop_back();
          continue;
        }
        state[raw] = 1;
        if (raw->next_edges().empty() || dynamic_cast<const torch::autograd::AccumulateGrad*>(raw)) {
          const bool param = !received.count(raw);
          state[raw] = param ? 2 : 3;
          stack.pop_back();
          continue;
        }
      }
      if (next < raw->next_edges().size()) {
        const auto& e = raw->next_edges()[next++];
        if (e.function && !state.count(e.function.get())) stack.emplace_back(e.function, 0);
        continue;
      }
      bool only_params = true, some_params = false;
      for (const auto& e : raw->next_edges()) {
        if (!e.function) continue;
        const int st = state[e.function.get()];
        only_params = only_params && st == 2;
        some_params = some_params || st == 2;
      }
      state[raw] = only_params ? 2 : 3;
      if (!only_params && some_params) {
        auto into = std::make_shared<torch::autograd::variable_list>();
        node->add_pre_hook(std::make_unique<Keep>(into));
        hooked_.push_back(Hooked{node, into, {}});
      }
      stack.pop_back();
    }
    // Each hooked node's parameters: the accumulators its parameters-only edges lead to.
    for (auto& h : hooked_) {
      std::unordered_set<const Node*> seen;
      std::vector<std::shared_ptr<Node>> frontier;
      for (const auto& e : h.node->next_edges())
        if (e.function && state[e.function.get()] == 2) frontier.push_back(e.function);
      while (!frontier.empty()) {
        std::shared_ptr<Node> n = frontier.back();
        frontier.pop_back();
        if (!seen.insert(n.get()).second) continue;
        if (dynamic_cast<const torch::autograd::AccumulateGrad*>(n.get())) {
          h.params.emplace_back(n, 0);
          continue;
        }
        for (const auto& e : n->next_edges())
          if (e.function) frontier.push_back(e.function);
      }
    }
    std::unordered_set<const Node*> reached;
    for (const auto& h : hooked_)
      for (const auto& e : h.params)
        if (!reached.insert(e.function.get()).second) return false;
    return true;
  }

  torch::autograd::edge_list roots_;
  torch::autograd::variable_list grads_;
  struct Hooked {
    std::shared_ptr<Node> node;
    std::shared_ptr<torch::autograd::variable_list> grads;  ///< what B handed the node
    torch::autograd::edge_list params;                      ///< the accumulators its weight edges lead to
  };
  std::vector<Hooked> hooked_;
  bool split_ = false;
};

}  // namespace

PipelineStage::PipelineStage(Communicator& pp_group, const PipelineConfig& cfg, int64_t micro_batches,
                             c10::Device device)
    : comm_(pp_group), cfg_(cfg), device_(device), stage_(pp_group.rank()), stages_(pp_group.size()),
      virtual_(cfg.virtual_stages) {
  const std::string e = pipeline_schedule_error(cfg.schedule, stages_, virtual_, micro_batches);
  PT_INPUT_CHECK(e.empty(), e);
  zero_bubble_ = cfg.schedule == "zbh1";
  micro_batches_ = micro_batches;
}

PipelineStage::~PipelineStage() = default;

void PipelineStage::apply(torch::nn::Module& model) {
  auto* planned = dynamic_cast<PipelinePlanned*>(&model);
  PT_INPUT_CHECK(planned != nullptr, "trainer.pipeline_parallel_size ", stages_, ": the model (", model.name(),
                 ") has no pipeline stage plan (GPT-2, BERT/RoBERTa, ALBERT and T5 have one)");
  plan_ = planned->pipeline_plan();
  const int64_t chunks = stages_ * virtual_;
  const std::string what = virtual_ > 1 ? cat("pipeline_parallel_size ", stages_, " x virtual_stages ", virtual_, " = ",
                                               chunks, " model chunks")
                                        : cat("trainer.pipeline_parallel_size ", stages_);
  // The model's layers, as users count them: its most frequent layer type (the transformer block).
  std::map<std::string, int64_t> by_type;
  for (const auto& l : plan_.layers) ++by_type[l.type];
  const auto block = std::max_element(by_type.begin(), by_type.end(),
                                      [](const auto& a, const auto& b) { return a.second < b.second; });
  PT_INPUT_CHECK(chunks <= block->second, what, " exceeds the model's ", block->second, " layers (", block->first,
                 "): every stage needs at least one");
  PT_INPUT_CHECK(virtual_ == 1 || block->second % chunks == 0, "pipeline.virtual_stages ", virtual_,
                 " does not divide the model's layers: ", block->second, " ", block->first, " layers over ", what);
  // Weights by partition method (DeepSpeed's PipelineModule partition_method).
  std::map<std::string, at::Tensor> named;
  for (const auto& item : model.named_parameters(true)) named[item.key()] = item.value();
  // The parameters each layer reads, by its name prefixes (once: the weights and the readers use them).
  std::vector<std::vector<std::string>> params_of;
  for (const auto& l : plan_.layers) {
    params_of.emplace_back();
    for (const auto& [name, p] : named)
      if (std::any_of(l.params.begin(), l.params.end(), [&](const std::string& pre) { return name.rfind(pre, 0) == 0; }))
        params_of.back().push_back(name);
  }
  std::vector<double> weights;
  const std::string& method = cfg_.partition;
  std::optional<std::regex> type_re;
  if (method.rfind("type:", 0) == 0) type_re.emplace(method.substr(5), std::regex::icase);
  for (size_t i = 0; i < plan_.layers.size(); ++i) {
    if (method == "uniform") {
      weights.push_back(1.0);
    } else if (type_re) {
      weights.push_back(std::regex_search(plan_.layers[i].type, *type_re) ? 1.0 : 0.0);
    } else {
      double w = 0;
      for (const auto& name : params_of[i]) w += static_cast<double>(named.at(name).numel());
      weights.push_back(w);
    }
  }
  bounds_ = partition_balanced(weights, chunks);
  const std::vector<int64_t>& bounds = bounds_;
  for (int64_t g = 0; g < chunks; ++g) {
    double w = 0;
    for (int64_t i = bounds[g]; i < bounds[g + 1]; ++i) w += weights[i];
    PT_INPUT_CHECK(w > 0, "pipeline.partition '", method, "' leaves stage ", g % stages_,
                   virtual_ > 1 ? cat(" (chunk ", g, ")") : std::string(), " with layers ",
                   plan_.layers[bounds[g]].name, " .. ", plan_.layers[bounds[g + 1] - 1].name,
                   " and nothing the partition counts; use 'parameters', 'uniform' or fewer stages");
  }
  // Who reads what: every stage works it out for every parameter, so all agree on the primaries.
  std::map<std::string, std::set<int64_t>> readers;
  for (int64_t g = 0; g < chunks; ++g)
    for (int64_t i = bounds[g]; i < bounds[g + 1]; ++i)
      for (const auto& name : params_of[i]) readers[name].insert(g % stages_);
  for (const auto& [name, p] : named)
    PT_CHECK(readers.count(name), "pipeline plan of ", model.name(), ": no layer reads parameter '", name, "'");
  chunks_.assign(virtual_, Chunk{});
  layer_count_ = 0;
  for (int64_t v = 0; v < virtual_; ++v) {
    const int64_t g = global_chunk(v);
    for (int64_t i = bounds[g]; i < bounds[g + 1]; ++i) {
      chunks_[v].layers.push_back(&plan_.layers[i]);
      if (first_layer_.empty()) first_layer_ = plan_.layers[i].name;
      last_layer_ = plan_.layers[i].name;
      ++layer_count_;
    }
  }
  for (const auto& [name, _] : module_state(model)) order_.push_back(name);
  torch::NoGradGuard no_grad;
  parameter_count_ = 0;
  for (auto& [name, p] : named) {
    params_[name] = p;
    shapes_[name] = p.sizes().vec();
    const std::set<int64_t>& r = readers.at(name);
    const int64_t primary = *r.begin();
    primary_[name] = primary;
    if (!r.count(stage_)) {
      dropped_.insert(name);
      p.set_data(at::empty({0}, p.options()));
      p.set_requires_grad(false);
    } else if (primary == stage_) {
      trained_.insert(name);
      parameter_count_ += p.numel();
      for (int64_t s : r)
        if (s != stage_) mirrors_on_[name].push_back(s);
    } else {
      mirror_of_[name] = primary;
    }
  }
  if (cfg_.activation_checkpoint_interval > 0) {
    auto* ac = dynamic_cast<ActivationCheckpointing*>(&model);
    PT_INPUT_CHECK(ac != nullptr, "pipeline.activation_checkpoint_interval: the model (", model.name(),
                   ") has no activation checkpointing");
    ac->set_activation_checkpointing(true);
  }
}

std::string PipelineStage::describe() const {
  return cat("stage ", stage_, " of ", stages_, ": layers ", first_layer_, " .. ", last_layer_, " (", layer_count_, " of ",
             plan_.layers.size(), virtual_ > 1 ? cat(", ", virtual_, " chunks") : std::string(), "), ",
             parameter_count_, " parameters trained", mirror_of_.empty() ? "" : cat(", ", mirror_of_.size(), " mirrored"));
}

std::string PipelineStage::layout() const {
  std::string s = cat("pipeline: ", virtual_ > 1 ? cat("interleaved 1f1b (", virtual_, " chunks per stage)") : cfg_.schedule,
                      ", ", micro_batches_, " micro-batches per step, partition ", cfg_.partition);
  for (int64_t st = 0; st < stages_; ++st) {
    s += cat(" | stage ", st, ":");
    for (int64_t v = 0; v < virtual_; ++v) {
      const int64_t g = v * stages_ + st;
      s += cat(v ? ", " : " ", plan_.layers[bounds_[g]].name, " .. ", plan_.layers[bounds_[g + 1] - 1].name);
    }
  }
  if (micro_batches_ < stages_) {
    char idle[16];
    std::snprintf(idle, sizeof idle, "%.0f%%", 100.0 * theoretical_bubble(stages_, 1, micro_batches_));
    s += cat(" | fewer micro-batches than stages: every stage idles ", idle, " of the step; raise "
             "gradient_accumulation_steps to a few times ", stages_);
  }
  return s;
}

void PipelineStage::Outbox::send(Communicator& comm, const at::Tensor& t, int dst, int tag) {
  tensors.push_back(t);
  works.push_back(comm.send_async(t, dst, tag));
}

void PipelineStage::Outbox::wait() {
  for (auto& w : works) w->wait();
  works.clear();
  tensors.clear();
}

void PipelineStage::send_map(const TensorMap& map, int dst, int tag, Outbox& out) {
  PT_CHECK(static_cast<int64_t>(map.size()) <= kMaxTensors, "pipeline: ", map.size(), " tensors in one message");
  std::vector<int64_t> header{static_cast<int64_t>(map.size())};
  std::vector<at::Tensor> bodies;
  for (const auto& [name, t] : map) {
    PT_CHECK(t.defined(), "pipeline: carry tensor '", name, "' is undefined");
    header.push_back(static_cast<int64_t>(t.scalar_type()));
    header.push_back(t.requires_grad() ? 1 : 0);
    header.push_back(t.dim());
    for (int64_t d : t.sizes()) header.push_back(d);
    header.push_back(static_cast<int64_t>(name.size()));
    for (char c : name) header.push_back(static_cast<unsigned char>(c));
    bodies.push_back(t.detach().contiguous());
  }
  // One message of kHeader words when the header fits (the usual carry), else a marker there and
  // the header in a second message: the receiver waits for one round trip before posting the bodies.
  const bool fits = static_cast<int64_t>(header.size()) <= kHeader;
  at::Tensor first = at::zeros({kHeader}, at::kLong);
  if (fits) {
    std::copy(header.begin(), header.end(), first.data_ptr<int64_t>());
  } else {
    first.data_ptr<int64_t>()[0] = -static_cast<int64_t>(header.size());
  }
  out.send(comm_, first.to(device_), dst, tag);
  if (!fits) out.send(comm_, at::tensor(header, at::kLong).to(device_), dst, tag + 1);
  for (size_t i = 0; i < bodies.size(); ++i) out.send(comm_, bodies[i], dst, tag + 2 + static_cast<int>(i));
}

TensorMap PipelineStage::recv_map(int src, int tag) {
  const auto t0 = Clock::now();
  at::Tensor head = at::empty({kHeader}, at::TensorOptions().dtype(at::kLong).device(device_));
  comm_.recv(head, src, tag);
  at::Tensor h = head.cpu();  // one copy to the host (a sync on a GPU) per header
  if (const int64_t n = h.data_ptr<int64_t>()[0]; n < 0) {  // a long header follows on its own
    head = at::empty({-n}, head.options());
    comm_.recv(head, src, tag + 1);
    h = head.cpu();
  }
  const int64_t* p = h.data_ptr<int64_t>();
  const int64_t* end = p + h.numel();
  auto next = [&]() {
    PT_CHECK(p < end, "pipeline: malformed message header from stage ", src);
    return *p++;
  };
  const int64_t n = next();
  TensorMap out;
  std::vector<std::pair<at::Tensor, bool>> posted;
  std::vector<std::unique_ptr<CommWork>> works;
  for (int64_t i = 0; i < n; ++i) {
    const auto dtype = static_cast<at::ScalarType>(next());
    const bool grad = next() != 0;
    std::vector<int64_t> shape(static_cast<size_t>(next()));
    for (auto& d : shape) d = next();
    std::string name(static_cast<size_t>(next()), ' ');
    for (auto& c : name) c = static_cast<char>(next());
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype).device(device_));
    works.push_back(comm_.recv_async(t, src, tag + 2 + static_cast<int>(i)));
    posted.emplace_back(t, grad);
    out[name] = t;
  }
  for (auto& w : works) w->wait();
  for (auto& [t, grad] : posted)
    if (grad) t.requires_grad_(true);
  stats_.wait_s += seconds_since(t0);
  return out;
}

void PipelineStage::run(MicroBatchRunner& runner, int64_t M, int64_t micro_size, const BackwardFn& backward) {
  const auto t_step = Clock::now();
  stats_ = PipelineStepStats{};
  const int64_t G = stages_ * virtual_;
  std::vector<TensorMap> inputs;
  for (int64_t m = 0; m < M; ++m) inputs.push_back(runner.read(micro_size));
  struct Flight {
    TensorMap received;                 // this chunk's inputs from the previous stage (leaves)
    std::vector<at::Tensor> outputs;    // what went on, that needs a gradient back (name order)
    at::Tensor loss;                    // the last chunk's weighted loss
    SplitBackward split;                // ZB-H1: its B and W passes
    Outbox sent;                        // its activations' sends: done, and let go, when it ends
  };
  std::map<std::pair<int64_t, int64_t>, Flight> flights;
  // A flight ends after its gradients came back, so its sends are long done: waiting frees them.
  auto end_flight = [&](const PipeAction& a) {
    flights[{a.micro, a.chunk}].sent.wait();
    flights.erase({a.micro, a.chunk});
  };
  Outbox sends;  // the gradients sent back
  const int64_t heap0 = heap_in_use();
  int64_t in_flight = 0;
  for (const PipeAction& a : pipeline_schedule(cfg_.schedule, stages_, virtual_, M, stage_)) {
    const int64_t g = global_chunk(a.chunk);
    Flight& f = flights[{a.micro, a.chunk}];
    if (a.forward) {
      TensorMap carry;
      if (g > 0) {
        carry = recv_map(stage_of_chunk(g - 1), kForwardTag);
        f.received = carry;
      }
      const auto t0 = Clock::now();
      runner.autocast([&] {
        for (const PipeLayer* l : chunks_[a.chunk].layers) l->run(inputs[a.micro], carry);
      });
      stats_.compute_s += seconds_since(t0);
      if (g == G - 1) {
        auto it = carry.find("loss");
        PT_CHECK(it != carry.end(), "pipeline plan: the last layer left no 'loss'");
        f.loss = runner.weigh(it->second, micro_size);
      } else {
        for (const auto& [name, t] : carry)
          if (t.requires_grad()) f.outputs.push_back(t);
        send_map(carry, stage_of_chunk(g + 1), kForwardTag, f.sent);
      }
      stats_.peak_in_flight = std::max(stats_.peak_in_flight, ++in_flight);
      stats_.peak_activation_bytes = std::max(stats_.peak_activation_bytes, heap_in_use() - heap0);
      continue;
    }
    if (a.weight) {  // ZB-H1's W: the weight gradients of a micro-batch whose B ran earlier
      const auto t0 = Clock::now();
      if (f.split.split()) ++stats_.split_backwards;
      f.split.weights();
      stats_.compute_s += seconds_since(t0);
      stats_.weight_s += seconds_since(t0);
      end_flight(a);
      --in_flight;
      continue;
    }
    // The roots of this chunk's backward: the loss, or the outputs with the next chunk's gradients.
    std::vector<at::Tensor> roots, root_grads;
    if (g == G - 1) {
      roots.push_back(f.loss);
      root_grads.push_back(at::ones_like(f.loss));
    } else {
      const auto t0 = Clock::now();
      std::vector<std::unique_ptr<CommWork>> works;
      for (size_t i = 0; i < f.outputs.size(); ++i) {
        root_grads.push_back(at::empty_like(f.outputs[i], at::MemoryFormat::Contiguous));
        works.push_back(comm_.recv_async(root_grads.back(), stage_of_chunk(g + 1), kBackwardTag + 2 + static_cast<int>(i)));
      }
      for (auto& w : works) w->wait();
      stats_.wait_s += seconds_since(t0);
      roots = f.outputs;
    }
    std::vector<at::Tensor> leaves;
    for (auto& [name, t] : f.received)
      if (t.requires_grad()) leaves.push_back(t);
    const auto t0 = Clock::now();
    std::vector<at::Tensor> input_grads;
    if (zero_bubble_) {
      // B: the input gradients only (the engine skips what leads to parameters); W runs later.
      input_grads = f.split.inputs(roots, root_grads, leaves);
    } else {
      // sum(out x grad) has gradient grad at out, exactly: one scalar for the strategy's backward.
      at::Tensor root;
      for (size_t i = 0; i < roots.size(); ++i) {
        at::Tensor term = g == G - 1 ? roots[i] : (roots[i] * root_grads[i]).sum();
        root = root.defined() ? root + term : term;
      }
      if (root.defined()) backward(root, MicroStep{micro_size, false});
      for (auto& t : leaves) input_grads.push_back(t.grad());
    }
    stats_.compute_s += seconds_since(t0);
    if (g > 0) {
      for (size_t i = 0; i < input_grads.size(); ++i) {
        at::Tensor grad = input_grads[i].defined() ? input_grads[i].contiguous() : at::zeros_like(leaves[i]);
        sends.send(comm_, grad, stage_of_chunk(g - 1), kBackwardTag + 2 + static_cast<int>(i));
      }
    }
    if (zero_bubble_) continue;  // the flight lives until its W
    end_flight(a);
    --in_flight;
  }
  sends.wait();
  exchange_mirror_grads(backward);
  stats_.step_s = seconds_since(t_step);
}

void PipelineStage::exchange_mirror_grads(const BackwardFn& backward) {
  if (mirror_of_.empty() && mirrors_on_.empty()) return;
  Outbox sends;
  // Mirrors send their summed gradient to the primary (one tag, in name order on both ends).
  for (const auto& [name, primary] : mirror_of_) {
    at::Tensor& p = params_.at(name);
    sends.send(comm_, p.grad().defined() ? p.grad().detach().contiguous() : at::zeros_like(p), static_cast<int>(primary),
               kMirrorTag);
  }
  at::Tensor root;
  const auto t0 = Clock::now();
  for (const auto& [name, from] : mirrors_on_) {
    const at::Tensor& p = params_.at(name);
    at::Tensor sum;
    for (int64_t s : from) {
      at::Tensor g = at::empty_like(p, at::MemoryFormat::Contiguous);
      comm_.recv(g, static_cast<int>(s), kMirrorTag);
      sum = sum.defined() ? sum + g : g;
    }
    at::Tensor term = (p * sum).sum();  // gradient `sum` at p, through the strategy's backward
    root = root.defined() ? root + term.to(at::kFloat) : term.to(at::kFloat);
  }
  stats_.wait_s += seconds_since(t0);
  if (root.defined()) backward(root, MicroStep{0, false});
  sends.wait();
  for (const auto& [name, _] : mirror_of_) params_.at(name).mutable_grad() = at::Tensor();
}

void PipelineStage::after_step() {
  if (mirror_of_.empty() && mirrors_on_.empty()) return;
  torch::NoGradGuard no_grad;
  Outbox sends;
  for (const auto& [name, to] : mirrors_on_) {
    const at::Tensor v = params_.at(name).detach().contiguous();
    for (int64_t s : to) sends.send(comm_, v, static_cast<int>(s), kMirrorTag);
  }
  for (const auto& [name, primary] : mirror_of_) {
    at::Tensor& p = params_.at(name);
    at::Tensor v = at::empty_like(p, at::MemoryFormat::Contiguous);
    comm_.recv(v, static_cast<int>(primary), kMirrorTag);
    p.detach().copy_(v);
  }
  sends.wait();
}

at::Tensor PipelineStage::forward_only(const TensorMap& inputs) {
  torch::NoGradGuard no_grad;
  const int64_t G = stages_ * virtual_;
  Outbox sends;
  at::Tensor loss;
  for (int64_t v = 0; v < virtual_; ++v) {
    const int64_t g = global_chunk(v);
    TensorMap carry = g > 0 ? recv_map(stage_of_chunk(g - 1), kEvalTag) : TensorMap{};
    for (const PipeLayer* l : chunks_[v].layers) l->run(inputs, carry);
    if (g == G - 1) {
      loss = carry.at("loss");
    } else {
      send_map(carry, stage_of_chunk(g + 1), kEvalTag, sends);
    }
  }
  sends.wait();
  return loss;
}

double PipelineStage::from_last(double value) {
  at::Tensor t = at::tensor({value}, at::kDouble).to(device_);
  comm_.broadcast(t, static_cast<int>(stages_ - 1));
  return t.item<double>();
}

double PipelineStage::sum(double value) { return sum_over_ranks(comm_, device_, value); }

NamedTensors PipelineStage::own(const NamedTensors& state) const {
  NamedTensors out;
  for (const auto& [name, t] : state)
    if (!dropped(name) && !mirrors(name)) out.emplace_back(name, t);
  return out;
}

NamedTensors PipelineStage::gather(NamedTensors own_state) {
  if (stage_ > 0) {
    Outbox sends;
    TensorMap mine;
    for (const auto& [name, t] : own_state)
      if (params_.count(name)) mine[name] = t.detach();  // buffers come from stage 0
    // In messages of at most kMaxTensors tensors: a count first.
    std::vector<TensorMap> parts(1);
    for (const auto& [name, t] : mine) {
      if (static_cast<int>(parts.back().size()) == kMaxTensors) parts.emplace_back();
      parts.back()[name] = t;
    }
    at::Tensor count = at::tensor({static_cast<int64_t>(parts.size())}, at::kLong).to(device_);
    comm_.send(count, 0, kGatherTag);
    for (const auto& part : parts) send_map(part, 0, kGatherTag + 64, sends);
    sends.wait();
    return own_state;
  }
  std::map<std::string, at::Tensor> all;
  for (auto& [name, t] : own_state) all[name] = t;
  for (int64_t s = 1; s < stages_; ++s) {
    at::Tensor count = at::empty({1}, at::TensorOptions().dtype(at::kLong).device(device_));
    comm_.recv(count, static_cast<int>(s), kGatherTag);
    for (int64_t i = 0; i < count.item<int64_t>(); ++i)
      for (auto& [name, t] : recv_map(static_cast<int>(s), kGatherTag + 64)) all[name] = t;
  }
  NamedTensors out;
  for (const auto& name : order_) {
    auto it = all.find(name);
    PT_CHECK(it != all.end(), "pipeline: no stage holds '", name, "'");
    out.emplace_back(name, it->second);
  }
  return out;
}

NamedTensors PipelineStage::select(const NamedTensors& whole) const {
  NamedTensors out;
  for (const auto& [name, t] : whole) out.emplace_back(name, dropped(name) ? at::empty({0}, t.options()) : t);
  return out;
}

void PipelineStage::release(torch::nn::Module& model) {
  (void)model;
  torch::NoGradGuard no_grad;
  for (const auto& name : order_) {
    auto it = params_.find(name);
    if (it == params_.end()) continue;
    at::Tensor& p = it->second;
    if (dropped(name)) {
      p.set_data(at::empty(shapes_.at(name), p.options()));
    }
    at::Tensor v = p.detach();
    comm_.broadcast(v, static_cast<int>(primary_.at(name)));
    if (dropped(name)) p.set_requires_grad(true);
  }
  dropped_.clear();
}

}  // namespace polytrain
