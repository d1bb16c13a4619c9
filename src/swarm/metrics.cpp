#include "polytrain/swarm/metrics.h"

#include <algorithm>
#include <cmath>
#include <msgpack.hpp>

#include "polytrain/swarm/msgpack_fields.h"

#include "polytrain/swarm/dht.h"
#include "polytrain/swarm/progress.h"

namespace polytrain::hivemind {

std::string encode_metrics(const StepMetrics& m) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_array(6);
  pk.pack_int64(m.step);
  pk.pack_double(m.loss);
  pk.pack_int64(m.samples);
  pk.pack_double(m.samples_per_second);
  pk.pack_int64(m.mini_steps);
  pk.pack_double(m.time);
  return std::string(buf.data(), buf.size());
}

std::optional<StepMetrics> decode_metrics(const std::string& payload) {
  try {
    msgpack::object_handle hold;
    const msgpack::object* f = fields::array_of(payload, 6, hold);
    if (!f) return std::nullopt;
    using fields::as_int, fields::as_num;
    StepMetrics m;
    if (!as_int(f[0], m.step) || !as_num(f[1], m.loss, true) || !as_int(f[2], m.samples) ||
        !as_num(f[3], m.samples_per_second, false) || !as_int(f[4], m.mini_steps) || !as_num(f[5], m.time, false))
      return std::nullopt;
    return m;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

MetricsPublisher::MetricsPublisher(DhtNode& dht, std::string key, std::chrono::milliseconds ttl)
    : dht_(dht), key_(std::move(key)), ttl_(ttl) {
  thread_ = std::thread([this] { loop(); });
}

MetricsPublisher::~MetricsPublisher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void MetricsPublisher::post(const StepMetrics& m) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_ = m;
  }
  cv_.notify_all();
}

uint64_t MetricsPublisher::published() const {
  std::lock_guard<std::mutex> lock(mu_);
  return published_;
}

void MetricsPublisher::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || pending_.has_value(); });
    if (!pending_) return;  // stopping; a record still pending (the run's last step) goes first
    StepMetrics m = *pending_;
    pending_.reset();
    lock.unlock();
    m.time = unix_seconds();
    const bool ok = dht_.store(key_, "metrics", encode_metrics(m), ttl_, std::chrono::seconds(1));
    lock.lock();
    published_ += ok;
  }
}

void SwarmMetrics::add(const std::string& peer_id, const StepMetrics& m, double now) {
  if (m.step <= last_final_) return;
  auto& p = pending_[m.step];
  if (p.changed == 0.0) p.changed = now;
  const auto [it, added] = p.peers.emplace(peer_id, m);
  if (added) p.changed = now;
  newest_ = std::max(newest_, m.step);
}

std::vector<SwarmStep> SwarmMetrics::take_final(double now, bool flush) {
  std::vector<SwarmStep> out;
  while (!pending_.empty()) {
    auto it = pending_.begin();
    const double quiet = now - it->second.changed;
    const bool done = flush || quiet >= linger_ || (newest_ > it->first && quiet >= grace_);
    if (!done) break;
    SwarmStep s;
    s.step = it->first;
    double weighted = 0.0;
    for (const auto& [id, m] : it->second.peers) {
      ++s.alive_peers;
      s.samples += m.samples;
      s.samples_per_second += m.samples_per_second;
      s.mini_steps += m.mini_steps;
      weighted += m.loss * static_cast<double>(std::max<int64_t>(m.samples, 1));
    }
    int64_t weight = 0;
    for (const auto& [id, m] : it->second.peers) weight += std::max<int64_t>(m.samples, 1);
    s.loss = weighted / static_cast<double>(weight);
    last_final_ = it->first;
    pending_.erase(it);
    out.push_back(s);
  }
  return out;
}

}  // namespace polytrain::hivemind
