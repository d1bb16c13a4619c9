// HivemindBackend: DHT node, progress tracker, matchmaker and averager of one swarm peer,
// driven by the Trainer loop through the Backend interface.
#include "polytrain/parallel/hivemind/hivemind_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <thread>

#include <torch/nn/module.h>

#include "polytrain/common/error.h"
#include "polytrain/data/sample_order.h"
#include "polytrain/parallel/hivemind/outer_optimizer.h"
#include "polytrain/swarm/butterfly.h"
#include "polytrain/swarm/dht.h"
#include "polytrain/swarm/matchmaking.h"
#include "polytrain/swarm/metrics.h"
#include "polytrain/swarm/progress.h"
#include "polytrain/swarm/record.h"
#include "polytrain/swarm/robust.h"
#include "polytrain/swarm/round_check.h"
#include "polytrain/swarm/state.h"
#include "polytrain/swarm/stream_limits.h"
#include "polytrain/checkpoint/archive_codec.h"
#include "polytrain/checkpoint/checkpoint.h"
#include "polytrain/optim/lr_schedule.h"
#include "polytrain/optim/optimizers.h"

namespace polytrain {

namespace hm = hivemind;
using std::chrono::milliseconds;

namespace {

milliseconds ms(double seconds) { return milliseconds(static_cast<int64_t>(seconds * 1000.0)); }

std::string short_id(const std::string& id) { return id.substr(0, 8); }

// Whether another peer can open a stream to `address` (their answers to a dial-back request).
// Asked first: the initial peers (a peer's averaging streams share its DHT port when --listen
// gave one); when none of them answers, up to 3 state donors announced so far. Each round of
// asking runs at once and ends within 3 s. "No" only when at least one helper answered and none
// could; `why` then names who said so.
bool reachable_by_others(hm::DhtNode& dht, const HivemindConfig& h, const std::string& address, std::string* why) {
  std::vector<std::string> asked;
  auto ask = [&](const std::vector<std::string>& candidates) -> std::optional<bool> {
    std::vector<std::string> helpers;
    for (const auto& a : candidates)
      if (!a.empty() && a != address && std::find(asked.begin(), asked.end(), a) == asked.end())
        helpers.push_back(a), asked.push_back(a);
    const auto deadline = hm::after(milliseconds(3000));
    std::vector<std::optional<bool>> answers(helpers.size());
    {
      std::vector<std::thread> t;
      for (size_t i = 0; i < helpers.size(); ++i)
        t.emplace_back([&, i] { answers[i] = hm::ask_dial_back(helpers[i], address, deadline); });
      for (auto& th : t) th.join();
    }
    std::string no;
    for (size_t i = 0; i < helpers.size(); ++i) {
      if (answers[i] == true) return true;
      if (answers[i] == false) no += (no.empty() ? "" : ", ") + helpers[i];
    }
    if (no.empty()) return std::nullopt;  // nobody answered: nothing learnt
    *why = no;
    return false;
  };
  if (const auto a = ask(h.initial_peers)) return *a;
  std::vector<std::string> donors;
  for (const auto& r : dht.fetch(h.run_id + "_state", milliseconds(1500))) {
    if (r.kind != "donor" || r.owner == dht.identity().public_key() || donors.size() >= 3) continue;
    if (const auto d = hm::decode_donor(r.payload)) donors.push_back(d->address);
  }
  return ask(donors).value_or(true);  // the first peer of a swarm has nobody to ask
}

// The benchmarks' hostile peer (bench/hivemind_centered_clip.sh): POLYTRAIN_HIVEMIND_POISON=F
// makes this peer send its gradients times F (-10: flipped and scaled) in every gradient round.
// 1 when unset; anything but a finite number is an InputError naming the variable.
double poison_factor() {
  static const double factor = [] {
    const char* v = std::getenv("POLYTRAIN_HIVEMIND_POISON");
    if (!v || !*v) return 1.0;
    char* end = nullptr;
    const double f = std::strtod(v, &end);
    PT_INPUT_CHECK(end && *end == '\0' && std::isfinite(f), "POLYTRAIN_HIVEMIND_POISON='", v,
                   "': expected a finite factor (e.g. -10)");
    return f;
  }();
  return factor;
}

}  // namespace

HivemindBackend::HivemindBackend(const Config& cfg) : ReplicatedBackend(cfg), h_(cfg.hivemind) {
  if (poison_factor() != 1.0)
    std::fprintf(stderr, "hivemind: POLYTRAIN_HIVEMIND_POISON: this peer sends its gradients times %g (a benchmark's hostile peer)\n",
                 poison_factor());
  const std::string batch_error = swarm_batch_error(cfg);  // a Config built in code skips the parser
  PT_INPUT_CHECK(batch_error.empty(), batch_error);
  configure_local_updates(cfg);
  identity_ = std::make_shared<const hm::Identity>(h_.identity_path.empty() ? hm::Identity::generate()
                                                                            : hm::Identity::load_or_create(h_.identity_path));
}

HivemindBackend::~HivemindBackend() {
  if (pending_.joinable()) pending_.join();
  // Release waiting followers and join streams first, then stop serving, then leave the DHT.
  if (matchmaker_) matchmaker_->stop();
  if (server_) server_->stop();
  metrics_.reset();
  tracker_.reset();
  server_.reset();
  donor_.reset();
  matchmaker_.reset();
  dht_.reset();
}

std::string HivemindBackend::dht_address() const { return dht_ ? dht_->address() : ""; }
std::string HivemindBackend::peer_id() const { return identity_->peer_id(); }

DataShard HivemindBackend::data_shard() const {
  DataShard s;
  s.own_stream = true;
  if (h_.num_streams > 0) {
    s.member = h_.stream_index, s.members = h_.num_streams;
  } else {
    // hivemind's peers each shuffle on their own: one stream, in an order keyed by the peer.
    const auto& k = identity_->public_key();
    uint64_t salt = 0;
    for (int i = 0; i < 8; ++i) salt = (salt << 8) | k[i];
    s.order_seed = salt | 1;
  }
  return s;
}

void HivemindBackend::prepare(std::shared_ptr<torch::nn::Module> model, const Config& cfg) {
  build(std::move(model), cfg, h_.offload_optimizer);
  if (h_.offload_optimizer)
    std::fprintf(stderr, "hivemind: offload_optimizer: the optimizer steps an fp32 copy of the parameters in CPU "
                 "memory%s\n", h_.delay_optimizer_step ? "; delay_optimizer_step: each update runs in the background while the next "
                 "micro-batches compute on the weights before it (one step stale)" : "");
  {
    // Served with the state, so the same on every peer of the swarm (the donors of one state
    // agree on its digest, and a newcomer stripes its download over all of them): the settings
    // the collaboration shares, not this peer's own (addresses, names, folders, threads).
    const nlohmann::json all = config_to_json(cfg);
    nlohmann::json shared = nlohmann::json::object();
    for (const char* k : {"model", "optimizer", "scheduler", "gradient_clipping", "fp16", "bf16"})
      if (all.contains(k)) shared[k] = all[k];
    for (const char* k : {"run_id", "target_batch_size", "compression", "average_state_every", "average_opt_statistics"})
      if (all.contains("hivemind") && all["hivemind"].contains(k)) shared["hivemind"][k] = all["hivemind"][k];
    if (outer_) shared["hivemind"]["outer_optimizer"] = outer_json_;
    config_json_ = shared.dump();
  }
  int64_t n = 0;
  for (const auto& p : params_) n += p.numel();
  // A state round carries the parameters and each averaged optimizer statistic of each.
  const int64_t copies = 1 + static_cast<int64_t>(h_.average_opt_statistics.size());
  flat_ = torch::empty({n * (h_.average_state_every > 0 ? copies : 1)}, torch::kFloat);
  prepare_local_updates(cfg);

  hm::DhtOptions o;
  o.run_id = h_.run_id;
  o.listen = h_.listen;
  o.initial_peers = h_.initial_peers;
  o.bootstrap_timeout = ms(h_.bootstrap_timeout);
  dht_ = std::make_unique<hm::DhtNode>(o, identity_);
  averager_ = std::make_unique<hm::Averager>();
  router_ = std::make_unique<hm::Router>();
  router_->on(hm::kMsgAllReduceHello, [this](hm::Connection& c, const hm::Frame& f) { averager_->handle(c, f); });
  hm::serve_dial_back(*router_);
  if (!h_.client_mode) {
    // Averaging streams use TCP on the DHT's port (UDP) when one was given, else any port.
    const auto [host, port] = hm::split_host_port(h_.listen, "hivemind.listen");
    const std::string tcp = (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port);
    // The swarm's quotas: per address, per service, a deadline for the first frame and a
    // lifetime per stream, so that connection churn or held streams cannot starve the rounds.
    const hm::SwarmStreamTimes times{ms(h_.averaging_timeout), ms(h_.load_state_timeout), ms(h_.next_chunk_timeout)};
    server_ = std::make_unique<hm::Server>(tcp, router_->handler(), "hivemind.listen", hm::swarm_stream_limits(times));
    address_ = h_.announce.empty() ? server_->address() : h_.announce;
    // A peer nobody can stream to (behind a NAT or a firewall) would be excluded from every
    // round as a sender that never came: it takes part as a client instead, as hivemind's
    // peers do when libp2p finds them unreachable.
    std::string refused_by;
    if (!reachable_by_others(*dht_, h_, address_, &refused_by)) {
      // An auxiliary peer that nobody can reach has nothing to offer.
      PT_INPUT_CHECK(!h_.assist_in_averaging, "hivemind.assist_in_averaging: no peer could open a stream to this "
                     "peer's averaging address ", address_, " (asked: ", refused_by, "); an auxiliary peer must accept "
                     "connections (--announce an address others can reach)");
      std::fprintf(stderr, "hivemind: no peer could open a stream to this peer's averaging address %s (asked: %s): "
                   "taking part in client mode (no inbound connections; pass --client_mode to skip this check, or "
                   "--announce an address others can reach)\n", address_.c_str(), refused_by.c_str());
      h_.client_mode = true;
      server_.reset();
      address_.clear();
    }
  }
  // An auxiliary peer never serves a state: its weights are not the swarm's.
  if (!h_.client_mode && !h_.assist_in_averaging) {
    donor_ = std::make_unique<hm::StateDonor>(dht_.get(), *router_, h_.run_id + "_state", address_,
                                              ms(h_.metadata_expiration));
    donor_->set_provider([this] {
      std::unique_lock<std::mutex> lock(state_mu_);
      state_cv_.wait(lock, [this] { return !update_pending_; });  // bounded by the update itself
      return hm::StateSnapshot{epoch_, snapshot(), {}};
    });
  }
  matchmaker_ = std::make_unique<hm::Matchmaker>(*dht_, *router_, identity_, address_);
  // A peer banned for repeated poisoning (butterfly.h's offences) gets no group from this one.
  matchmaker_->set_banned([this](const std::string& id) { return averager_->offences().banned(id); });
  // batch_size_lead: the target this peer steps at is lowered by the lead (hivemind's albert
  // example hands its optimizer target_batch_size - batch_size_lead).
  tracker_ = std::make_unique<hm::ProgressTracker>(
      *dht_, hm::ProgressTracker::Options{h_.run_id + "_progress", h_.target_batch_size - h_.batch_size_lead,
                                          h_.client_mode, h_.metadata_expiration, 0.0, h_.assist_in_averaging},
      epoch_);
  tracker_->publish_now();
  metrics_ = std::make_unique<hm::MetricsPublisher>(*dht_, h_.run_id + "_metrics", ms(h_.metadata_expiration));
  std::printf("hivemind: %speer %s of run '%s' on %s (DHT, UDP)%s%s; others join with --initial_peers %s\n",
              h_.assist_in_averaging ? "auxiliary " : "", short_id(peer_id()).c_str(), h_.run_id.c_str(),
              dht_->address().c_str(), h_.client_mode ? ", client mode (no inbound connections)" : ", averaging on ",
              h_.client_mode ? "" : (address_ + " (TCP)").c_str(), dht_->address().c_str());
  if (h_.assist_in_averaging)
    std::printf("hivemind: assist_in_averaging: this peer trains nothing; it joins every averaging round to reduce a "
                "share of it (bandwidth %g) and adds nothing to the averages\n", h_.bandwidth);
  if (h_.batch_size_lead > 0)
    std::printf("hivemind: batch_size_lead %lld: this peer steps once the swarm has %lld samples (target_batch_size %lld "
                "less the lead)\n", static_cast<long long>(h_.batch_size_lead),
                static_cast<long long>(h_.target_batch_size - h_.batch_size_lead),
                static_cast<long long>(h_.target_batch_size));
  std::fflush(stdout);

  if (h_.expected_peers > 1 && !h_.assist_in_averaging) {
    // Reproducible runs: every expected peer is present before the first global step.
    const auto deadline = std::chrono::steady_clock::now() + ms(h_.averaging_timeout);
    size_t seen = 0;
    for (;;) {
      const auto g = tracker_->global(true);
      known_peers_.clear();
      for (const auto& p : g.others)
        if (!p.client_mode && !p.auxiliary) known_peers_.insert(p.peer_id);
      seen = known_peers_.size() + (h_.client_mode ? 0 : 1);
      if (static_cast<int64_t>(seen) >= h_.expected_peers || std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(milliseconds(20));
    }
    PT_INPUT_CHECK(static_cast<int64_t>(seen) >= h_.expected_peers, "hivemind.expected_peers: ", seen, " of ",
                   h_.expected_peers, " trainer peers of run '", h_.run_id, "' appeared within averaging_timeout (",
                   h_.averaging_timeout, " s)");
    std::printf("hivemind: the %lld expected peers are present (%.1f s)\n", static_cast<long long>(h_.expected_peers),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - deadline + ms(h_.averaging_timeout)).count());
    std::fflush(stdout);
  }
}

std::string HivemindBackend::snapshot() const {
  // A checkpoint's state.pt and shard_0.pt, byte for byte (a monitor saves them as they come),
  // encoded as safetensors (archive_codec.h): a newcomer never hands a peer's bytes to libtorch.
  hm::PeerState s;
  s.epoch = epoch_;
  {
    NamedTensors state;
    // With offload_optimizer the copy the optimizer steps (the model may lag it by one update);
    // with local updates the outer parameters (the local ones differ from peer to peer).
    for (const auto& [name, t] : outer_ ? outer_state() : state_with_masters(*model_))
      state.emplace_back(name, t.detach().to(torch::kCPU));
    torch::serialize::OutputArchive a, m;
    save_named_tensors(state, m);
    a.write("model", m);
    s.model = encode_archive(a);
  }
  if (outer_) {
    s.optimizer = outer_optimizer_bytes();
  } else {
    torch::serialize::OutputArchive o;
    optimizer_->save(o);
    s.optimizer = encode_archive(o);
  }
  s.config = config_json_;
  return hm::pack_peer_state(s);
}

void HivemindBackend::restore(const std::string& bytes, const std::string& origin) {
  const auto s = hm::unpack_peer_state(bytes);
  PT_INPUT_CHECK(s, origin, ": not a polytrain peer state (another program in the same run_id?)");
  NamedTensors loaded;
  {
    torch::serialize::InputArchive a, m;
    decode_archive(s->model, origin + " (model)", a);
    a.read("model", m);
    loaded = load_named_tensors_archive(m);
  }
  // Every tensor is checked before anything changes: a mismatch leaves this peer as it was.
  std::map<std::string, const at::Tensor*> index;
  for (const auto& [name, t] : loaded) index[name] = &t;
  const auto mine = module_state(*model_);
  PT_INPUT_CHECK(index.size() == mine.size(), origin, ": holds ", index.size(), " tensors, this model has ", mine.size(),
                 " (another model in the same run_id?)");
  for (const auto& [name, t] : mine) {
    const auto it = index.find(name);
    PT_INPUT_CHECK(it != index.end(), origin, ": has no tensor '", name, "' (another model in the same run_id?)");
    PT_INPUT_CHECK(it->second->sizes() == t.sizes(), origin, ": tensor '", name, "' has shape ", it->second->sizes(),
                   ", this model's ", t.sizes(), " (another model in the same run_id?)");
  }
  at::Tensor outer_momentum;
  {
    torch::serialize::InputArchive opt;
    decode_archive(s->optimizer, origin + " (optimizer)", opt);
    // Local updates: the outer momentum; this peer's inner optimizer keeps its own state.
    if (!outer_) optimizer_->load(opt, origin);
    else
      PT_INPUT_CHECK(opt.try_read(hm::kOuterMomentumKey, outer_momentum), origin, ": has no outer momentum (a swarm "
                     "without hivemind.outer_optimizer in the same run_id?)");
  }
  if (outer_) outer_->load_momentum(outer_momentum, origin);
  load_module_state(*model_, loaded, origin);
  load_masters(loaded);
  if (outer_) outer_->reset(held());
  zero_grads();
  epoch_ = s->epoch;
}

void HivemindBackend::donate() {
  if (donor_) donor_->announce(epoch_);
}

bool HivemindBackend::reload_from_peers(const std::string& why) {
  finish_update();
  hm::DownloadOptions o;
  o.timeout = ms(h_.load_state_timeout);
  o.request_timeout = ms(h_.request_timeout);
  o.next_chunk_timeout = ms(h_.next_chunk_timeout);
  o.min_epoch = epoch_ + 1;
  // A state is this model's parameters and at most a few copies more (optimizer moments).
  int64_t n = 0;
  for (const auto& p : params_) n += p.numel();
  o.max_bytes = static_cast<uint64_t>(n) * 4 * 8 + (uint64_t{64} << 20);
  const auto until = std::chrono::steady_clock::now() + o.timeout;
  hm::DownloadReport rep;
  std::optional<hm::StateSnapshot> s;
  for (;;) {
    // Never a state at an epoch the swarm does not vouch for (a peer's claim alone): the
    // vouched epoch as of now. Donors answer with their state of the moment, which in a swarm
    // that steps faster than its progress records spread can be past what this peer read: it
    // reads again and asks again while the load's time lasts (not for an epoch beyond what the
    // swarm's throughput can have reached: a forged one).
    const auto g = tracker_->global(true);
    o.max_epoch = g.epoch;
    o.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (o.timeout.count() <= 0) break;
    s = hm::load_state_from_peers(*dht_, h_.run_id + "_state", o, &rep);
    if (s || rep.newer_than_vouched < 0 || rep.newer_than_vouched > g.reachable) break;
  }
  for (const auto& f : rep.donors_failed) std::fprintf(stderr, "hivemind: state donor %s\n", f.c_str());
  if (!s) {
    std::fprintf(stderr, "hivemind: %s, but could not load the swarm's state: %s\n", why.c_str(),
                 rep.why_none.empty() ? "the load's time ran out" : rep.why_none.c_str());
    return false;
  }
  const int64_t before = epoch_;
  try {
    std::lock_guard<std::mutex> lock(state_mu_);
    restore(s->bytes, "state from peers");
  } catch (const std::exception& e) {
    // Peers in the run with another model (or a corrupt donor): this peer keeps its own state
    // (restore() checks every shape before it changes anything).
    std::fprintf(stderr, "hivemind: %s, but the swarm's state does not load here: %s\n", why.c_str(), e.what());
    std::lock_guard<std::mutex> lock(state_mu_);
    epoch_ = before;
    return false;
  }
  std::printf("hivemind: %s: loaded the swarm's state at epoch %lld (this peer was at %lld) from %zu donor(s), "
              "%.1f MB in %.2f s\n",
              why.c_str(), static_cast<long long>(epoch_), static_cast<long long>(before), rep.donors_used.size(),
              static_cast<double>(rep.bytes) / 1e6, rep.seconds);
  std::fflush(stdout);
  tracker_->update_epoch(epoch_);
  return true;
}

void HivemindBackend::report_unvouched(const hm::GlobalProgress& g) {
  if (g.claimed_epoch <= g.epoch || reported_claim_) return;
  reported_claim_ = true;
  const std::string who = "peer " + g.claimant.substr(0, 8);
  if (g.claimed_epoch > g.reachable)
    std::fprintf(stderr,
                 "hivemind: %s claims epoch %lld, beyond what the swarm's throughput allows (at most %lld by now): "
                 "this peer stays with the swarm's epoch %lld (said once)\n",
                 who.c_str(), static_cast<long long>(g.claimed_epoch), static_cast<long long>(g.reachable),
                 static_cast<long long>(g.epoch));
  else
    std::fprintf(stderr,
                 "hivemind: %s claims epoch %lld, but fewer than %d of the other trainers have reached it: this "
                 "peer stays with the swarm's epoch %lld (said once)\n",
                 who.c_str(), static_cast<long long>(g.claimed_epoch), std::max(1, g.vouchers),
                 static_cast<long long>(g.epoch));
}

void HivemindBackend::report_progress(const hm::GlobalProgress& g) const {
  // hivemind's ProgressTracker logs each fetch of the swarm's progress and fetches again after
  // clip(eta x n / max(n + 3, 1.2 n), min_refresh_period, max_refresh_period) seconds (n peers;
  // its albert example's periods: 0.5 and 30 s). This peer's tracker fetches far more often for
  // its own decisions; the line keeps hivemind's cadence. Not before the swarm has a throughput
  // (no ETA to give yet).
  const double now = hm::unix_seconds();
  if (now < next_progress_line_ || !(g.samples_per_second > 0.0)) return;
  const double eta = std::max(0.0, g.eta_next_epoch - now);
  const double n = static_cast<double>(g.num_peers);
  next_progress_line_ = now + std::clamp(eta * n / std::max(n + 3.0, 1.2 * n), 0.5, 30.0);
  std::printf("hivemind: Collaboration accumulated %lld samples from %d peers; ETA %.2f seconds\n",
              static_cast<long long>(g.samples_accumulated), g.num_peers, eta);
  std::fflush(stdout);
}

int64_t HivemindBackend::catch_up(int64_t step) {
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    epoch_ = step;
    if (outer_) outer_->reset(held());  // the weights a resume loaded
  }
  tracker_->update_epoch(epoch_);
  const auto g = tracker_->global(true);
  report_unvouched(g);
  if (h_.assist_in_averaging) {  // it holds no state worth loading: it follows the swarm's epoch
    epoch_ = std::max(epoch_, g.epoch);
    tracker_->update_epoch(epoch_);
    return epoch_;
  }
  if (g.epoch > epoch_) reload_from_peers(step == 0 ? "joining a swarm at epoch " + std::to_string(g.epoch)
                                                     : "resumed at epoch " + std::to_string(step) +
                                                           ", the swarm is at " + std::to_string(g.epoch));
  donate();
  return epoch_;
}

void HivemindBackend::set_global_step(int64_t step) {
  std::lock_guard<std::mutex> lock(state_mu_);
  epoch_ = step;
  if (tracker_) tracker_->update_epoch(epoch_);
}

bool HivemindBackend::known_peers_announced(int64_t epoch) const {
  const auto g = tracker_->global(true);
  for (const auto& id : known_peers_) {
    bool in = false;
    for (const auto& p : g.others)
      if (p.peer_id == id && (p.epoch > epoch || (p.epoch == epoch && p.samples_accumulated + p.samples_in_flight > 0)))
        in = true;
    if (!in) return false;
  }
  return true;
}

int64_t HivemindBackend::next_micro_batch(int64_t micro_steps_done, int64_t samples_done) const {
  // The loop also asks one micro-batch ahead, before the backward of the current one (to tell
  // DDP when to communicate): that look-ahead changes nothing here.
  if (samples_done != accounted_) return micro_;
  if (micro_steps_done > 0) {
    // The first global step of a run with expected_peers waits for every expected peer (a
    // peer that joined the DHT late may still be starting); later ones for request_timeout.
    const bool first = h_.expected_peers > 1 && !stepped_;
    const auto deadline = std::chrono::steady_clock::now() + ms(first ? h_.averaging_timeout : h_.request_timeout);
    while (!known_peers_announced(epoch_) && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(milliseconds(1));
    const auto g = tracker_->global(true);
    report_progress(g);
    if (hm::ready_to_update_epoch(g, epoch_, hm::unix_seconds())) {
      swarm_samples_ = std::max(g.samples_reserved, g.samples_accumulated);
      return 0;
    }
  }
  tracker_->reserve(micro_);
  tracker_->publish_now();
  micro_start_ = std::chrono::steady_clock::now();
  return micro_;
}

void HivemindBackend::backward(const at::Tensor& loss, const MicroStep& m) {
  loss.backward();
  // A delayed update that is done reaches the model between two micro-batches (its graph is gone).
  if (pending_done_.load()) finish_update();
  loss_sum_ = loss_sum_.defined() ? loss_sum_ + loss.detach().to(torch::kDouble) : loss.detach().to(torch::kDouble);
  ++mini_steps_;
  accounted_ += m.samples;
  tracker_->report_local_step(
      m.samples, std::chrono::duration<double>(std::chrono::steady_clock::now() - micro_start_).count());
  if (outer_) inner_step(m.samples);
}

size_t HivemindBackend::average_flat(std::vector<at::Tensor> tensors, bool grads, const void* group_ptr, double weight,
                                   std::chrono::steady_clock::time_point round_end, int64_t epoch,
                                   const std::string& what) {
  torch::NoGradGuard no_grad;
  const int64_t n = fill_flat(tensors, grads);
  const size_t averaged = allreduce_flat(n, grads, group_ptr, weight, round_end, epoch, what);
  if (!grads) keep_own_where_implausible(tensors, group_ptr, static_cast<size_t>(n), epoch, what);
  int64_t off = 0;
  for (auto& t : tensors) {
    if (grads && !t.grad().defined()) t.mutable_grad() = torch::zeros_like(t);
    at::Tensor dst = grads ? t.grad() : t;
    dst.copy_(flat_.narrow(0, off, t.numel()).view(t.sizes()));
    off += t.numel();
  }
  return averaged;
}

int64_t HivemindBackend::fill_flat(const std::vector<at::Tensor>& tensors, bool grads) {
  torch::NoGradGuard no_grad;
  int64_t off = 0;
  for (const auto& t : tensors) {
    const at::Tensor src = grads ? t.grad() : t;
    auto dst = flat_.narrow(0, off, t.numel());
    if (src.defined()) dst.copy_(src.reshape({-1}));
    else dst.zero_();
    off += t.numel();
  }
  return off;
}

size_t HivemindBackend::allreduce_flat(int64_t n, bool grads, const void* group_ptr, double weight,
                                       std::chrono::steady_clock::time_point round_end, int64_t epoch,
                                       const std::string& what) {
  const auto& group = *static_cast<const hm::Group*>(group_ptr);
  if (grads && poison_factor() != 1.0) flat_.narrow(0, 0, n).mul_(poison_factor());
  const auto report = averager_->allreduce(group, flat_.data_ptr<float>(), static_cast<size_t>(n), weight,
                                           allreduce_options(grads, round_end, epoch));
  sent_bytes_ += static_cast<int64_t>(report.bytes_sent);
  received_bytes_ += static_cast<int64_t>(report.bytes_received);
  const std::string warning = report.warning();
  if (!warning.empty())
    std::fprintf(stderr, "hivemind: epoch %lld %s: %s\n", static_cast<long long>(epoch), what.c_str(), warning.c_str());
  std::set<std::string> failed(report.failed_reducers.begin(), report.failed_reducers.end());
  failed.insert(report.excluded_senders.begin(), report.excluded_senders.end());
  failed.insert(report.rejected_senders.begin(), report.rejected_senders.end());
  failed.insert(report.banned_members.begin(), report.banned_members.end());
  // The members whose contributions went in: auxiliary peers have none.
  size_t members = 0, members_failed = 0;
  for (const auto& m : group.members)
    if (!m.auxiliary) ++members, members_failed += failed.count(m.peer_id);
  return members - std::min(members_failed, members - 1);
}

void HivemindBackend::keep_own_where_implausible(const std::vector<at::Tensor>& own, const void* group_ptr, size_t n,
                                                 int64_t epoch, const std::string& what) {
  // A parameter round's answer replaces what this peer holds, so a reducer could install any
  // values it likes: each part is checked against this peer's own copy (round_check.h), and a
  // part that is not finite or lands too far from it is not applied (its own values stay there).
  const auto& group = *static_cast<const hm::Group*>(group_ptr);
  torch::NoGradGuard no_grad;
  int64_t params = 0;
  for (const auto& p : params_) params += p.numel();
  hm::ParameterRoundCheck check(hm::part_sizes(n, group), static_cast<size_t>(params));
  float* average = flat_.data_ptr<float>();
  int64_t off = 0;
  for (const auto& t : own) {
    const at::Tensor mine = t.detach().reshape({-1}).to(torch::kCPU, torch::kFloat).contiguous();
    check.add(static_cast<size_t>(off), average + off, mine.data_ptr<float>(), static_cast<size_t>(t.numel()));
    off += t.numel();
  }
  for (const size_t j : check.failed_parts()) {
    const auto [begin, end] = check.part_range(j);
    std::fprintf(stderr, "hivemind: epoch %lld %s: the part reduced by peer %s (%zu values) is discarded: %s; this "
                 "peer keeps its own values there\n", static_cast<long long>(epoch), what.c_str(),
                 short_id(group.members[j].peer_id).c_str(), end - begin, check.why(j).c_str());
    off = 0;
    for (const auto& t : own) {
      const int64_t lo = std::max<int64_t>(static_cast<int64_t>(begin), off);
      const int64_t hi = std::min<int64_t>(static_cast<int64_t>(end), off + t.numel());
      if (lo < hi) flat_.narrow(0, lo, hi - lo).copy_(t.detach().reshape({-1}).narrow(0, lo - off, hi - lo));
      off += t.numel();
    }
  }
}

hm::AllReduceOptions HivemindBackend::allreduce_options(bool grads, std::chrono::steady_clock::time_point round_end,
                                                        int64_t epoch) const {
  hm::AllReduceOptions o;
  o.compression = hm::parse_compression(h_.compression);
  const auto left = std::chrono::duration_cast<milliseconds>(round_end - std::chrono::steady_clock::now());
  o.allreduce_timeout = std::max(milliseconds(1), std::min(ms(h_.allreduce_timeout > 0 ? h_.allreduce_timeout : h_.averaging_timeout), left));
  o.next_chunk_timeout = ms(h_.next_chunk_timeout);
  // A member's samples in one global step stay below twice the swarm's target (the target plus
  // what was in flight); a parameter round weighs every member 1.
  o.max_weight = grads ? 2.0 * static_cast<double>(h_.target_batch_size) : 1.0;
  // Local updates: every peer continues from the same outer parameters, compression or not.
  o.same_result = grads && outer_ != nullptr;
  if (grads) {  // tau is in gradient units: the parameter round stays a plain mean
    o.aggregation = hm::parse_aggregation(h_.aggregation);
    o.centered_clip_tau = h_.centered_clip_tau;
    o.centered_clip_iterations = static_cast<int>(h_.centered_clip_iterations);
    // A member's weight is at most what its own signed progress claims at this epoch.
    if (tracker_) o.sender_max_weight = tracker_->signed_weights(epoch).as_function();
  }
  return o;
}

void HivemindBackend::finish_update() {
  if (!pending_.joinable()) return;
  pending_.join();
  pending_done_ = false;
  if (pending_error_) std::rethrow_exception(std::exchange(pending_error_, nullptr));
  masters_to_params();
}

NamedTensors HivemindBackend::full_state(torch::nn::Module& model) {
  finish_update();
  // Local updates: a checkpoint holds the swarm's model, not this peer's local steps since.
  return outer_ ? outer_state() : ReplicatedBackend::full_state(model);
}

void HivemindBackend::save_shard(torch::serialize::OutputArchive& archive) {
  finish_update();
  ReplicatedBackend::save_shard(archive);
  if (outer_) archive.write(hm::kOuterMomentumKey, outer_->momentum());
}

void HivemindBackend::average_state(const void* group, std::chrono::steady_clock::time_point round_end,
                                    int64_t epoch) {
  // The parameters, then each statistic of every parameter (hivemind's TrainingStateAverager
  // with average_opt_statistics). A statistic the update has not created yet (a parameter
  // that never had a gradient anywhere) travels as zeros and is not written back. Averages
  // land in the tensors statistic() gave, which are the optimizer's storage, or copies (8-bit
  // optimizers): set_statistic puts them back either way (nothing to do for storage).
  const std::vector<at::Tensor>& held = masters_.empty() ? params_ : masters_;
  std::vector<at::Tensor> tensors = held;
  std::vector<bool> defined;
  std::string what = "parameters";
  for (const auto& name : h_.average_opt_statistics) {
    what += ", " + name;
    for (const auto& p : held) {
      at::Tensor s = optimizer_->statistic(p, name);
      defined.push_back(s.defined());
      tensors.push_back(s.defined() ? s : torch::zeros_like(p));
    }
  }
  average_flat(tensors, /*grads=*/false, group, 1.0, round_end, epoch, what);
  size_t i = 0;
  for (const auto& name : h_.average_opt_statistics)
    for (const auto& p : held) {
      if (defined[i]) optimizer_->set_statistic(p, name, tensors[held.size() + i]);
      ++i;
    }
}

/// What the phases of one step() share.
struct HivemindBackend::StepRound {
  std::chrono::steady_clock::time_point deadline;  ///< for everything step() waits on
  int64_t local = 0;                               ///< this peer's samples of the step
  int64_t epoch = 0;                               ///< the epoch of the round
  std::string missed;                              ///< why rejoin() reloads the state
  bool moved_on = false;                           ///< matchmaking found the swarm past `epoch`
  std::optional<hm::Group> group;                  ///< the gradient round's group, if one formed
  std::optional<hm::Group> state;                  ///< the state round's group, when this step has one
};

void HivemindBackend::scale_to_local_mean(int64_t local) {
  // The loop normalised each micro-batch by samples_per_step() (= one micro-batch): make the
  // gradient this peer's mean over its `local` samples before averaging.
  torch::NoGradGuard no_grad;
  const double scale = static_cast<double>(micro_) / static_cast<double>(local);
  if (scale != 1.0)
    for (auto& p : params_)
      if (p.grad().defined()) p.grad().mul_(scale);
}

bool HivemindBackend::rejoin(const StepRound& round, StepResult* r) {
  // The swarm finished this epoch's round without this peer (it ran late, or was loading):
  // its local progress is dropped and the state reloaded. False when that reload failed.
  if (!reload_from_peers(round.missed)) return false;
  zero_grads();
  known_peers_.clear();
  accounted_ = 0;
  loss_sum_ = at::Tensor();
  mini_steps_ = 0;
  r->outcome = StepOutcome::kNoUpdate;
  r->global_step = epoch_;
  r->samples = round.local;
  r->contributed_samples = contributed_;  // the dropped samples went into no step
  donate();
  return true;
}

bool HivemindBackend::rejoin_if_alone(const StepRound& round, StepResult* r) {
  // Nobody is left to average with.
  const auto g = tracker_->global_by(round.deadline);
  bool others_here = false;
  for (const auto& p : g.others)
    if (!p.client_mode && !p.auxiliary && p.epoch == round.epoch) others_here = true;
  return g.epoch > round.epoch && !others_here && rejoin(round, r);
}

void HivemindBackend::find_gradient_group(StepRound& round) {
  const int64_t round_epoch = round.epoch;
  const auto deadline = round.deadline;
  hm::MatchmakingOptions mo;
  mo.key = h_.run_id + "_grad_" + std::to_string(round_epoch);
  mo.matchmaking_time = ms(h_.matchmaking_time);
  mo.request_timeout = ms(h_.request_timeout);
  mo.min_group_size = static_cast<size_t>(h_.min_group_size);
  mo.target_group_size = static_cast<size_t>(h_.target_group_size);
  mo.bandwidth = h_.bandwidth;
  mo.auxiliary = h_.assist_in_averaging;
  // The leader starts as soon as every peer that announced samples for this epoch joined, and
  // every auxiliary peer at this epoch (it announces no samples, but joins each round).
  auto expected = [this, round_epoch, deadline]() -> size_t {
    const auto g = tracker_->global_by(deadline);
    size_t n = 1;
    for (const auto& p : g.others)
      if (p.epoch == round_epoch && (p.auxiliary || p.samples_accumulated + p.samples_in_flight > 0)) ++n;
    return n;
  };
  // Others at this epoch may be dead peers whose records have not expired yet: once a
  // declaration expired without a group and the swarm is past this epoch, the round is over.
  auto abandon = [&] {
    const auto by = std::min(deadline, std::chrono::steady_clock::now() + ms(h_.request_timeout));
    round.moved_on = tracker_->global_by(by).epoch > round_epoch;
    return round.moved_on;
  };
  round.group = matchmaker_->find_group(mo, expected, deadline, abandon);
}

size_t HivemindBackend::average_gradients(const StepRound& round) {
  const auto& group = round.group;
  const int64_t round_epoch = round.epoch, local = round.local;
  const bool moved_on = round.moved_on;
  known_peers_.clear();
  size_t averaged = 1;
  if (group && group->members.size() > 1) {
    // Peers that were working on this epoch or the one before but are not in the group came
    // late (a newcomer still computing on the state it loaded, a slow client): the next epoch
    // gives them request_timeout to announce their samples before it fills without them, or a
    // peer whose micro-batch takes as long as the swarm's epoch misses every round (seen: a
    // newcomer chasing the swarm for 7 epochs, one reload each).
    std::set<std::string> late;
    for (const auto& p : tracker_->global(false).others)
      if ((p.epoch == round_epoch || p.epoch + 1 == round_epoch) && p.samples_accumulated + p.samples_in_flight > 0)
        late.insert(p.peer_id);
    // Local updates: flat_ holds this peer's pseudo-gradient already (outer minus local).
    averaged = outer_ ? allreduce_flat(outer_->numel(), /*grads=*/true, &*group, static_cast<double>(local),
                                       round.deadline, round_epoch, "pseudo-gradients")
                      : average_flat(params_, /*grads=*/true, &*group, static_cast<double>(local), round.deadline,
                                     round_epoch, "gradients");
    // hivemind's line after each averaging round that formed a group: the members averaged in
    // full, this peer included (a failed member is named in the warning above instead).
    if (averaged > 1) {
      std::printf("hivemind: Averaged tensors successfully with %zu peers\n", averaged);
      std::fflush(stdout);
    }
    for (size_t i = 0; i < group->members.size(); ++i) {
      if (i != group->self && !group->members[i].address.empty() && !group->members[i].auxiliary)
        known_peers_.insert(group->members[i].peer_id);
      late.erase(group->members[i].peer_id);
    }
    known_peers_.insert(late.begin(), late.end());
  } else {
    std::fprintf(stderr, "hivemind: epoch %lld: no averaging group formed %s; %s on this peer's %lld local samples\n",
                 static_cast<long long>(round_epoch),
                 moved_on ? "(the swarm moved on and its state could not be loaded)"
                          : ("within " + std::to_string(static_cast<int>(h_.averaging_timeout)) + " s (alone or timed out)").c_str(),
                 outer_ ? "the outer step uses its own pseudo-gradient" : "stepping", static_cast<long long>(local));
  }
  return averaged;
}

void HivemindBackend::plan_state_round(StepRound& round) {
  // Local updates: the outer step leaves every member with the same parameters already.
  const bool state_round = !outer_ && round.group && round.group->members.size() > 1 && h_.average_state_every > 0 &&
                           (round.epoch + 1) % h_.average_state_every == 0;
  if (state_round) {
    round.state = *round.group;
    round.state->group_id += "/state";
  }
}

StepResult HivemindBackend::update_in_background(const StepRequest& request, int64_t step, const StepRound& round) {
  const int64_t round_epoch = round.epoch;
  const std::optional<hm::Group>& state = round.state;
  // The averaged gradients move to the offloaded copy; the update and the state round run in
  // the background while the next micro-batches compute on the weights before it (one step
  // stale, as hivemind's delay_optimizer_step); the model gets the result at the first
  // micro-batch boundary after it is done, or at the next step at the latest. The skip
  // decision (a non-finite norm) is taken here, so the loop's loss scaler sees it at once.
  grads_to_masters();
  zero_model_grads();
  UpdateOutcome u;
  u.grad_norm = grad_norm(masters_) * update_options(request, clip_).grad_scale;
  u.applied = std::isfinite(u.grad_norm);
  StepResult r = step_result(u, step, global_batch_);
  std::lock_guard<std::mutex> lock(state_mu_);
  epoch_ = round_epoch + 1;
  if (u.applied) {
    update_pending_ = true;
    pending_ = std::thread([this, request, state, round_epoch] {
      try {
        update_masters(request);
        // In the background the state round has an averaging_timeout of its own.
        if (state) average_state(&*state, std::chrono::steady_clock::now() + ms(h_.averaging_timeout), round_epoch);
      } catch (...) {
        pending_error_ = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(state_mu_);
        update_pending_ = false;
      }
      state_cv_.notify_all();
      pending_done_ = true;
    });
  } else {
    for (auto& m : masters_) m.mutable_grad() = at::Tensor();
  }
  return r;
}

StepResult HivemindBackend::update_now(const StepRequest& request, int64_t step, const StepRound& round) {
  // From the update to the next epoch the state changes: a donor's snapshot waits.
  std::lock_guard<std::mutex> lock(state_mu_);
  StepResult r = update(request, step);
  zero_grads();
  if (round.state) {
    // Within the step's averaging_timeout, as the gradient round: step() never waits
    // longer for its averaging. A state round left without time fails at once and every
    // member keeps its parameters (the next one averages them).
    average_state(&*round.state, round.deadline, round.epoch);
    if (!masters_.empty()) masters_to_params();
  }
  epoch_ = round.epoch + 1;
  return r;
}

void HivemindBackend::enter_next_epoch() {
  // The next epoch. A peer that finds the swarm more than one epoch ahead reloads its state;
  // when that fails it jumps to the swarm's epoch with its own weights.
  const auto g = tracker_->global(false);
  report_unvouched(g);
  if (g.epoch > epoch_ && !reload_from_peers("the swarm is at epoch " + std::to_string(g.epoch) + ", this peer at " +
                                             std::to_string(epoch_))) {
    std::fprintf(stderr, "hivemind: jumping ahead to epoch %lld with this peer's weights\n", static_cast<long long>(g.epoch));
    std::lock_guard<std::mutex> lock(state_mu_);
    epoch_ = g.epoch;
  }
  tracker_->update_epoch(epoch_);
  donate();
}

void HivemindBackend::post_metrics(const StepRequest& request, const StepRound& round) {
  // For monitors: this peer's share of the global step it took part in. backward() received
  // each micro-batch's mean loss x loss_scale x samples / micro-batch.
  hm::StepMetrics sm;
  sm.step = round.epoch + 1;
  const double loss_sum = loss_sum_.defined() ? loss_sum_.item<double>() : 0.0;
  sm.loss = loss_sum * static_cast<double>(micro_) / (request.loss_scale * static_cast<double>(round.local));
  sm.samples = round.local;
  sm.samples_per_second = tracker_->samples_per_second();
  sm.mini_steps = mini_steps_;
  if (std::isfinite(sm.loss)) metrics_->post(sm);
}

bool HivemindBackend::assist_round(const void* group_ptr, size_t n, bool grads,
                                   std::chrono::steady_clock::time_point round_end, int64_t epoch,
                                   const std::string& what) {
  const auto& group = *static_cast<const hm::Group*>(group_ptr);
  // Nothing of this peer's goes in: flat_ only holds its part of the others' vectors.
  const auto report = averager_->allreduce(group, flat_.data_ptr<float>(), n, 0.0, allreduce_options(grads, round_end, epoch));
  sent_bytes_ += static_cast<int64_t>(report.bytes_sent);
  received_bytes_ += static_cast<int64_t>(report.bytes_received);
  const std::string warning = report.warning();
  if (!warning.empty())
    std::fprintf(stderr, "hivemind: epoch %lld %s: %s\n", static_cast<long long>(epoch), what.c_str(), warning.c_str());
  size_t trainers = 0;
  for (const auto& m : group.members) trainers += !m.auxiliary;
  std::printf("hivemind: assisted in averaging epoch %lld's %s: reduced %.1f%% of them (%zu of %zu values) from %zu of "
              "%zu peers in %.2f s\n",
              static_cast<long long>(epoch), what.c_str(), n ? 100.0 * static_cast<double>(report.part_elements) / n : 0.0,
              report.part_elements, n, report.part_senders, trainers, report.seconds);
  std::fflush(stdout);
  return report.part_senders > 0;
}

int64_t HivemindBackend::assist(int64_t step, int64_t until) {
  // hivemind's auxiliary Optimizer.step(), in a loop: wait until the swarm is ready to end the
  // epoch (as its trainers decide: the target reached, its ETA passed or a peer already past
  // it), take part in the epoch's gradient round and its state round, then follow the swarm
  // into the next epoch (max(epoch + 1, the swarm's), hivemind's rule; a round it missed is
  // left behind as soon as the swarm moves past it).
  PT_CHECK(h_.assist_in_averaging, "assist() on a trainer peer");
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    epoch_ = std::max(epoch_, step);
  }
  tracker_->update_epoch(epoch_);
  int64_t n = 0;
  for (const auto& p : params_) n += p.numel();
  const size_t copies = 1 + h_.average_opt_statistics.size();
  int64_t rounds = 0, assisted = 0;
  const auto t0 = std::chrono::steady_clock::now();
  while (until <= 0 || epoch_ < until) {
    const auto g = tracker_->global(true);
    if (g.epoch > epoch_) {  // the swarm moved on (a round this peer missed, or it just started)
      epoch_ = g.epoch;
      tracker_->update_epoch(epoch_);
      continue;
    }
    // A swarm with no throughput yet has no ETA: the target or a later epoch decides.
    const bool ready = hm::ready_to_update_epoch(g, epoch_, hm::unix_seconds()) &&
                       (g.samples_per_second > 0 || std::max(g.samples_accumulated, g.samples_reserved) >= g.target_batch_size);
    if (!ready) {
      std::this_thread::sleep_for(milliseconds(50));
      continue;
    }
    StepRound round;
    round.deadline = std::chrono::steady_clock::now() + ms(h_.averaging_timeout);
    round.epoch = epoch_;
    find_gradient_group(round);
    bool trainers = false;
    if (round.group)
      for (const auto& m : round.group->members) trainers = trainers || !m.auxiliary;
    if (!trainers) {
      // The round may still be ahead (an ETA that passed early): try again until the swarm
      // moves past this epoch.
      if (!round.moved_on)
        std::fprintf(stderr, "hivemind: epoch %lld: no averaging group to assist within %d s\n",
                     static_cast<long long>(round.epoch), static_cast<int>(h_.averaging_timeout));
      const auto now_g = tracker_->global(true);
      if (now_g.epoch > epoch_) epoch_ = now_g.epoch, tracker_->update_epoch(epoch_);
      continue;
    }
    ++rounds;
    const bool helped = assist_round(&*round.group, static_cast<size_t>(n), /*grads=*/true, round.deadline, round.epoch,
                                     outer_ ? "pseudo-gradients" : "gradients");
    assisted += helped;
    plan_state_round(round);
    if (round.state) {
      std::string what = "parameters";
      for (const auto& name : h_.average_opt_statistics) what += ", " + name;
      // The trainers start it after their update (or in the background with
      // delay_optimizer_step, with an averaging_timeout of its own).
      assist_round(&*round.state, static_cast<size_t>(n) * copies, /*grads=*/false,
                   std::chrono::steady_clock::now() + ms(h_.averaging_timeout), round.epoch, what);
    }
    sent_bytes_ = 0, received_bytes_ = 0;
    epoch_ = std::max(round.epoch + 1, tracker_->global(false).epoch);
    tracker_->update_epoch(epoch_);
  }
  std::printf("hivemind: auxiliary peer done at epoch %lld: reduced a share of %lld of %lld rounds it joined in %.1f s\n",
              static_cast<long long>(epoch_), static_cast<long long>(assisted), static_cast<long long>(rounds),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  std::fflush(stdout);
  return epoch_;
}

StepResult HivemindBackend::step(const StepRequest& request, int64_t step) {
  finish_update();
  // One deadline for everything step() waits on (the progress refreshes, matchmaking, the
  // gradient and state rounds): a slow DHT fetch under faults shortens the round instead of
  // stretching the step past averaging_timeout.
  StepRound round;
  round.deadline = std::chrono::steady_clock::now() + ms(h_.averaging_timeout);
  round.local = accounted_;
  PT_CHECK(round.local > 0, "hivemind step with no local samples");
  stepped_ = true;
  if (!outer_) scale_to_local_mean(round.local);
  round.epoch = epoch_;
  round.missed = "epoch " + std::to_string(round.epoch) + " ended without this peer";
  {
    StepResult r;
    if (rejoin_if_alone(round, &r)) return r;
  }
  find_gradient_group(round);
  if (!round.group && round.moved_on) {
    StepResult r;
    if (rejoin(round, &r)) return r;
  }
  if (outer_) outer_->pseudo_gradient(held(), flat_);
  const size_t averaged = average_gradients(round);
  plan_state_round(round);
  StepResult r;
  if (outer_)
    r = outer_update(step, round.epoch, round.local);
  else if (h_.delay_optimizer_step)
    r = update_in_background(request, step, round);
  else
    r = update_now(request, step, round);
  enter_next_epoch();
  post_metrics(request, round);
  accounted_ = 0;
  loss_sum_ = at::Tensor();
  mini_steps_ = 0;
  r.global_step = epoch_;
  r.samples = std::max<int64_t>(swarm_samples_, round.local);
  r.group_size = static_cast<int64_t>(averaged);
  contributed_ += round.local;
  r.contributed_samples = contributed_;
  r.sent_bytes = sent_bytes_.exchange(0);
  r.received_bytes = received_bytes_.exchange(0);
  return r;
}

}  // namespace polytrain
