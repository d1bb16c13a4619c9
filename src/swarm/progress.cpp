#include "polytrain/swarm/progress.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <functional>
#include <msgpack.hpp>

#include "polytrain/swarm/msgpack_fields.h"

#include "polytrain/common/error.h"
#include "polytrain/swarm/dht.h"

namespace polytrain::hivemind {

double unix_seconds() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

std::string encode_progress(const PeerProgress& p) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_array(7);
  pk.pack_int64(p.epoch);
  pk.pack_int64(p.samples_accumulated);
  pk.pack_double(p.samples_per_second);
  pk.pack_double(p.time);
  if (p.client_mode) pk.pack_true(); else pk.pack_false();
  pk.pack_int64(p.samples_in_flight);
  if (p.auxiliary) pk.pack_true(); else pk.pack_false();
  return std::string(buf.data(), buf.size());
}

std::optional<PeerProgress> decode_progress(const std::string& payload) {
  try {
    msgpack::object_handle hold;
    const msgpack::object* f = fields::array_of(payload, 7, hold);
    if (!f) return std::nullopt;
    using fields::as_int, fields::as_num;
    PeerProgress p;
    if (!as_int(f[0], p.epoch) || !as_int(f[1], p.samples_accumulated) || !as_num(f[2], p.samples_per_second) ||
        !as_num(f[3], p.time) || f[4].type != msgpack::type::BOOLEAN || !as_int(f[5], p.samples_in_flight) ||
        f[6].type != msgpack::type::BOOLEAN)
      return std::nullopt;
    p.client_mode = f[4].via.boolean;
    p.auxiliary = f[6].via.boolean;
    if (p.auxiliary && p.client_mode) return std::nullopt;  // an auxiliary peer accepts streams
    return p;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

int epoch_vouchers(int m) { return m <= 2 ? m : std::max(2, m / 2 + 1); }

int64_t reachable_epoch(const EpochBaseline& base, double samples_per_second, int64_t target_batch_size, double now) {
  if (base.epoch < 0) return INT64_MAX;
  const double epochs = 2.0 * std::max(0.0, samples_per_second) * std::max(0.0, now - base.time) /
                        static_cast<double>(std::max<int64_t>(1, target_batch_size));
  // Far beyond any real run, and no overflow for a forged throughput.
  return base.epoch + 1 + static_cast<int64_t>(std::min(epochs, 1e15));
}

double robust_throughput(std::vector<double> samples_per_second) {
  samples_per_second.erase(std::remove_if(samples_per_second.begin(), samples_per_second.end(),
                                          [](double s) { return !(s > 0.0); }),
                           samples_per_second.end());
  if (samples_per_second.empty()) return 0.0;
  const size_t mid = (samples_per_second.size() - 1) / 2;  // the lower median
  std::nth_element(samples_per_second.begin(), samples_per_second.begin() + mid, samples_per_second.end());
  const double cap = kMaxThroughputRatio * samples_per_second[mid];
  double sum = 0.0;
  for (double s : samples_per_second) sum += std::min(s, cap);
  return sum;
}

SignedWeights::SignedWeights(const std::vector<PeerProgress>& records, int64_t epoch)
    : typical_(std::numeric_limits<double>::infinity()) {
  std::vector<double> claims;
  for (const auto& p : records) {
    const double samples = static_cast<double>(p.samples_accumulated) + static_cast<double>(p.samples_in_flight);
    if (p.epoch != epoch || p.auxiliary || !(samples > 0)) continue;
    claimed_[p.peer_id] = samples;
    claims.push_back(samples);
  }
  if (claims.empty()) return;
  const size_t mid = (claims.size() - 1) / 2;
  std::nth_element(claims.begin(), claims.begin() + mid, claims.end());
  typical_ = claims[mid];
  for (auto& [id, c] : claimed_) c = std::min(c, kMaxThroughputRatio * typical_);
}

double SignedWeights::bound(const std::string& peer_id) const {
  const auto it = claimed_.find(peer_id);
  return it == claimed_.end() ? typical_ : it->second;
}

std::function<double(const std::string&)> SignedWeights::as_function() const {
  return [w = *this](const std::string& peer_id) { return w.bound(peer_id); };
}

EpochBaseline advance_baseline(const EpochBaseline& base, const GlobalProgress& g, double now, bool self_trained) {
  if (base.epoch < 0) return g.vouchers > 0 || self_trained ? EpochBaseline{g.epoch, now} : base;
  return g.epoch > base.epoch ? EpochBaseline{g.epoch, now} : base;
}

GlobalProgress aggregate_progress(const std::vector<PeerProgress>& others, const PeerProgress& self,
                                  int64_t target_batch_size, double now, double min_refresh, double max_refresh,
                                  const EpochBaseline& base) {
  GlobalProgress g;
  g.target_batch_size = target_batch_size;
  g.others = others;
  // Auxiliary peers train nothing: listed in `others`, counted in nothing else.
  std::vector<PeerProgress> all;
  for (const auto& p : others)
    if (p.auxiliary) ++g.num_auxiliary;
    else all.push_back(p);
  if (self.auxiliary) ++g.num_auxiliary;
  else all.push_back(self);
  // No epoch on one peer's word: the vouchers-th highest epoch of the other trainers that have
  // trained (a newcomer still loading has no throughput yet and does not vote), and none beyond
  // what the swarm's throughput can have reached since this peer last saw it move.
  std::vector<double> rates;
  for (const auto& p : all) rates.push_back(p.samples_per_second);
  g.reachable = reachable_epoch(base, robust_throughput(rates), target_batch_size, now);
  std::vector<int64_t> epochs;
  g.claimed_epoch = self.epoch;
  for (const auto& p : others) {
    if (p.client_mode || p.auxiliary) continue;
    if (p.epoch > g.claimed_epoch) g.claimed_epoch = p.epoch, g.claimant = p.peer_id;
    if (p.samples_per_second > 0.0 && p.epoch <= g.reachable) epochs.push_back(p.epoch);
  }
  for (const auto& p : all) g.num_clients += p.client_mode;
  g.vouchers = epoch_vouchers(static_cast<int>(epochs.size()));
  g.epoch = self.epoch;
  if (g.vouchers > 0) {
    std::nth_element(epochs.begin(), epochs.begin() + (g.vouchers - 1), epochs.end(), std::greater<int64_t>());
    g.epoch = std::max(g.epoch, epochs[g.vouchers - 1]);
  }
  g.num_peers = static_cast<int>(all.size());
  double total_sps = 0.0, estimated = 0.0;
  for (const auto& p : all) {
    total_sps += p.samples_per_second;
    if (p.epoch != g.epoch) continue;
    g.samples_accumulated += p.samples_accumulated;
    g.samples_reserved += p.samples_accumulated + p.samples_in_flight;
    estimated += static_cast<double>(p.samples_accumulated) + std::max(0.0, now - p.time) * p.samples_per_second;
  }
  g.samples_per_second = total_sps;
  const double remaining = static_cast<double>(target_batch_size) - estimated;
  const double eta = total_sps > 0 ? std::max(0.0, remaining) / total_sps : (remaining > 0 ? max_refresh : 0.0);
  g.eta_next_epoch = now + eta;
  // hivemind refreshes sooner when more peers may come (expected drift of 3 peers or 20%).
  const double n = g.num_peers;
  const double expected_max = std::max(n + 3.0, n * 1.2);
  g.next_fetch_time = now + std::clamp(eta * n / expected_max, min_refresh, max_refresh);
  return g;
}

bool ready_to_update_epoch(const GlobalProgress& g, int64_t local_epoch, double now) {
  return g.epoch > local_epoch || std::max(g.samples_accumulated, g.samples_reserved) >= g.target_batch_size || now >= g.eta_next_epoch;
}

ProgressTracker::ProgressTracker(DhtNode& dht, Options o, int64_t epoch) : dht_(dht), o_(std::move(o)) {
  PT_CHECK(o_.expiration >= 11.0, "progress expiration ", o_.expiration, " s (OpenDHT needs >= 11 s)");
  local_.epoch = epoch;
  local_.client_mode = o_.client_mode;
  local_.auxiliary = o_.auxiliary;
  local_.time = unix_seconds();
  global_ = aggregate_progress({}, local_, o_.target_batch_size, local_.time);
  thread_ = std::thread([this] { loop(); });
}

ProgressTracker::~ProgressTracker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

PeerProgress ProgressTracker::snapshot() const {
  PeerProgress p = local_;
  p.samples_per_second = ema_sps_;
  return p;
}

void ProgressTracker::report_local_step(int64_t samples, double seconds) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    local_.samples_accumulated += samples;
    local_.samples_in_flight = 0;
    local_.time = unix_seconds();
    if (seconds > 0) {
      const double sps = static_cast<double>(samples) / seconds;
      ema_sps_ = ema_sps_ == 0.0 ? sps : 0.1 * sps + 0.9 * ema_sps_;  // hivemind's PerformanceEMA
    }
    dirty_ = true;
  }
  cv_.notify_all();
}

void ProgressTracker::reserve(int64_t samples) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    local_.samples_in_flight = samples;
    dirty_ = true;
  }
  cv_.notify_all();
}

void ProgressTracker::update_epoch(int64_t epoch) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    local_.epoch = epoch;
    local_.samples_accumulated = 0;
    local_.samples_in_flight = 0;
    local_.time = unix_seconds();
    dirty_ = true;
  }
  cv_.notify_all();
}

int64_t ProgressTracker::local_epoch() const {
  std::lock_guard<std::mutex> lock(mu_);
  return local_.epoch;
}

int64_t ProgressTracker::local_samples() const {
  std::lock_guard<std::mutex> lock(mu_);
  return local_.samples_accumulated;
}

double ProgressTracker::samples_per_second() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ema_sps_;
}

GlobalProgress ProgressTracker::global(bool refresh) {
  std::unique_lock<std::mutex> lock(mu_);
  if (refresh) {
    fetch_wanted_ = true;
    cv_.notify_all();
    cv_.wait_for(lock, std::chrono::seconds(5), [&] { return !fetch_wanted_ || stop_; });
  }
  return global_;
}

GlobalProgress ProgressTracker::global_by(std::chrono::steady_clock::time_point until) {
  std::unique_lock<std::mutex> lock(mu_);
  fetch_wanted_ = true;
  cv_.notify_all();
  cv_.wait_until(lock, std::min(until, std::chrono::steady_clock::now() + std::chrono::seconds(5)),
                 [&] { return !fetch_wanted_ || stop_; });
  return global_;
}

bool ProgressTracker::publish_now() {
  std::lock_guard<std::mutex> one_at_a_time(publish_mu_);
  PeerProgress p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    p = snapshot();
    dirty_ = false;
    last_publish_ = unix_seconds();
  }
  return dht_.store(o_.key, "progress", encode_progress(p),
                    std::chrono::milliseconds(static_cast<int64_t>(o_.expiration * 1000)), std::chrono::seconds(3));
}

SignedWeights ProgressTracker::signed_weights(int64_t epoch) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PeerProgress> records = global_.others;
  PeerProgress self = local_;
  self.peer_id = to_hex(dht_.identity().public_key());
  records.push_back(self);
  return SignedWeights(records, epoch);
}

GlobalProgress ProgressTracker::fetch_and_aggregate() {
  const auto records = dht_.fetch(o_.key, std::chrono::seconds(2));
  std::vector<PeerProgress> others;
  const auto& me = dht_.identity().public_key();
  for (const auto& r : records) {
    if (r.owner == me || r.kind != "progress") continue;
    if (auto p = decode_progress(r.payload)) {
      p->peer_id = to_hex(r.owner);
      others.push_back(*p);
    }
  }
  PeerProgress self;
  {
    std::lock_guard<std::mutex> lock(mu_);
    self = snapshot();
  }
  const double now = unix_seconds();
  GlobalProgress g = aggregate_progress(others, self, o_.target_batch_size, now, 0.05, 5.0, baseline_);
  baseline_ = advance_baseline(baseline_, g, now, self.samples_per_second > 0.0);
  return g;
}

void ProgressTracker::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    const double now = unix_seconds();
    const bool publish = (dirty_ && now - last_publish_ >= o_.min_publish_interval) ||
                         now - last_publish_ >= o_.expiration / 2;
    const bool fetch = fetch_wanted_ || now >= global_.next_fetch_time;
    if (!publish && !fetch) {
      double wake = std::min(global_.next_fetch_time, last_publish_ + o_.expiration / 2);
      if (dirty_) wake = std::min(wake, last_publish_ + o_.min_publish_interval);
      cv_.wait_for(lock, std::chrono::duration<double>(std::clamp(wake - now, 0.001, 1.0)));
      continue;
    }
    lock.unlock();
    if (publish) publish_now();
    if (fetch) {
      GlobalProgress g = fetch_and_aggregate();
      lock.lock();
      global_ = g;
      fetch_wanted_ = false;
      cv_.notify_all();
      lock.unlock();
    }
    lock.lock();
  }
}

}  // namespace polytrain::hivemind
