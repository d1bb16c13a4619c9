#include "polytrain/swarm/metrics.h"

#include <algorithm>
#include <cmath>
#include <msgpack.hpp>

#include "polytrain/swarm/msgpack_fields.h"

#include "polytrain/swarm/dht.h"
#include "polytrain/swarm/progress.h"

namespace polytrain::hivemind {

std::string encode_metrics(const std::vector<StepMetrics>& recent) {
  const size_t n = std::min(recent.size(), kMetricsHistory);
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_array(2);
  pk.pack_double(recent.empty() ? 0.0 : recent.back().time);
  pk.pack_array(static_cast<uint32_t>(n));
  for (size_t i = recent.size() - n; i < recent.size(); ++i) {
    const StepMetrics& m = recent[i];
    pk.pack_array(5);
    pk.pack_int64(m.step);
    pk.pack_double(m.loss);
    pk.pack_int64(m.samples);
    pk.pack_double(m.samples_per_second);
    pk.pack_int64(m.mini_steps);
  }
  return std::string(buf.data(), buf.size());
}

std::optional<std::vector<StepMetrics>> decode_metrics(const std::string& payload) {
  try {
    if (!fields::bounded_msgpack(payload.data(), payload.size(), 3)) return std::nullopt;
    const msgpack::object_handle hold = msgpack::unpack(payload.data(), payload.size());
    const msgpack::object& o = hold.get();
    if (o.type != msgpack::type::ARRAY || o.via.array.size != 2) return std::nullopt;
    using fields::as_int, fields::as_num;
    double time = 0.0;
    const msgpack::object& list = o.via.array.ptr[1];
    if (!as_num(o.via.array.ptr[0], time, false) || list.type != msgpack::type::ARRAY || list.via.array.size == 0 ||
        list.via.array.size > kMetricsHistory)
      return std::nullopt;
    std::vector<StepMetrics> out;
    for (uint32_t i = 0; i < list.via.array.size; ++i) {
      const msgpack::object& e = list.via.array.ptr[i];
      if (e.type != msgpack::type::ARRAY || e.via.array.size != 5) return std::nullopt;
      const msgpack::object* f = e.via.array.ptr;
      StepMetrics m;
      m.time = time;
      if (!as_int(f[0], m.step) || !as_num(f[1], m.loss, true) || !as_int(f[2], m.samples) ||
          !as_num(f[3], m.samples_per_second, false) || !as_int(f[4], m.mini_steps))
        return std::nullopt;
      if (!out.empty() && m.step <= out.back().step) return std::nullopt;
      out.push_back(m);
    }
    return out;
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
    // Steps only grow: a step posted again (or an older one) replaces what follows it.
    while (!recent_.empty() && recent_.back().step >= m.step) recent_.pop_back();
    recent_.push_back(m);
    if (recent_.size() > kMetricsHistory) recent_.erase(recent_.begin());
    pending_ = true;
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
    cv_.wait(lock, [&] { return stop_ || pending_; });
    if (!pending_) return;  // stopping; a record still pending (the run's last step) goes first
    std::vector<StepMetrics> recent = recent_;
    pending_ = false;
    lock.unlock();
    recent.back().time = unix_seconds();
    const bool ok = dht_.store(key_, "metrics", encode_metrics(recent), ttl_, std::chrono::seconds(1));
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
