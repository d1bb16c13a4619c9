#include "polytrain/parallel/hivemind/butterfly.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>
#include <thread>

#include "polytrain/common/error.h"

namespace polytrain::hivemind {
namespace {

constexpr size_t kMaxGroupId = 256;
constexpr size_t kMaxElements = size_t{1} << 34;

size_t chunks_of(size_t len, size_t chunk) { return (len + chunk - 1) / chunk; }

Deadline earliest(Deadline a, Deadline b) { return std::min(a, b); }

// Every element is written before it is read: no zero-filling pass over part-sized buffers.
std::unique_ptr<float[]> uninitialized(size_t n) { return std::unique_ptr<float[]>(new float[std::max<size_t>(n, 1)]); }

}  // namespace

std::string AllReduceReport::warning() const {
  if (failed_reducers.empty() && excluded_senders.empty()) return "";
  std::ostringstream os;
  if (!failed_reducers.empty()) {
    os << "averaging: " << failed_reducers.size() << " reducer(s) failed, " << std::fixed;
    os.precision(1);
    os << 100.0 * local_fraction << "% of the vector kept its local values";
  }
  if (!excluded_senders.empty())
    os << (failed_reducers.empty() ? "averaging: " : "; ") << excluded_senders.size()
       << " sender(s) excluded from this peer's part";
  return os.str();
}

std::vector<size_t> part_sizes(size_t n, const Group& g) {
  std::vector<double> bw(g.members.size(), 0.0);
  for (size_t i = 0; i < bw.size(); ++i)
    if (!g.members[i].address.empty() && g.members[i].bandwidth > 0 && std::isfinite(g.members[i].bandwidth))
      bw[i] = g.members[i].bandwidth;
  const double total = std::accumulate(bw.begin(), bw.end(), 0.0);
  PT_CHECK(total > 0, "a group with no member that reduces (all clients)");
  std::vector<size_t> sizes(bw.size(), 0);
  std::vector<std::pair<double, size_t>> rem;
  size_t given = 0;
  for (size_t i = 0; i < bw.size(); ++i) {
    const double exact = static_cast<double>(n) * bw[i] / total;
    sizes[i] = static_cast<size_t>(std::floor(exact));
    given += sizes[i];
    if (bw[i] > 0) rem.emplace_back(exact - std::floor(exact), i);
  }
  // Largest remainder first; ties to the lower index: the same on every member.
  std::stable_sort(rem.begin(), rem.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (size_t k = 0; given < n; ++k, ++given) ++sizes[rem[k % rem.size()].second];
  return sizes;
}

struct Averager::Round {
  enum class State { kWaiting, kReceiving, kComplete, kFailed };
  struct Sender {
    State state = State::kWaiting;
    double weight = 0.0;
    std::unique_ptr<float[]> values;  // decoded part
  };
  std::string group_id;
  size_t self = 0, members = 0, len = 0, chunk = 0;
  Compression compression = Compression::kNone;
  Deadline deadline, first_contact;
  std::chrono::milliseconds next_chunk{0};
  std::mutex mu;
  std::condition_variable cv;
  std::map<size_t, Sender> senders;  // every member but self
  bool averaged = false;
  std::unique_ptr<float[]> average;
};

Averager::Averager() = default;
Averager::~Averager() = default;

size_t Averager::rounds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rounds_.size();
}

std::shared_ptr<Averager::Round> Averager::wait_for_round(const std::string& group_id, Deadline until) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_until(lock, until, [&] { return rounds_.count(group_id) > 0; });
  auto it = rounds_.find(group_id);
  return it == rounds_.end() ? nullptr : it->second;
}

void Averager::handle(Connection& c, const Frame& hello) {
  Reader rd(hello.payload);
  const std::string group_id = rd.str(kMaxGroupId);
  const size_t sender = rd.u32(), part = rd.u32();
  const uint64_t len = rd.u64();
  const uint32_t comp = rd.u32();
  const double weight = rd.f64();
  const uint64_t chunk = rd.u64();
  auto refuse = [&](const std::string& why) {
    try {
      c.send(kMsgRefuse, why, after(std::chrono::milliseconds(1000)));
    } catch (const NetError&) {
    }
  };
  // A member may reach this peer a little before this peer starts the round.
  auto round = wait_for_round(group_id, after(std::chrono::milliseconds(5000)));
  if (!round) return refuse("no averaging round " + group_id + " here");
  Round& r = *round;
  if (part != r.self || len != r.len || comp != static_cast<uint32_t>(r.compression) || chunk != r.chunk ||
      !(weight >= 0.0 && weight < 1e15) || len > kMaxElements)
    return refuse("hello does not match the round (part, length, compression, chunk or weight)");
  Round::Sender* s = nullptr;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.senders.find(sender);
    if (it == r.senders.end() || it->second.state != Round::State::kWaiting || r.averaged)
      return refuse("sender index unknown, duplicate, or too late");
    s = &it->second;
    s->state = Round::State::kReceiving;
    s->weight = weight;
  }
  auto fail = [&] {
    std::lock_guard<std::mutex> lock(r.mu);
    s->state = Round::State::kFailed;
    s->values.reset();
    r.cv.notify_all();
  };
  // Receive the part, chunk by chunk (uncompressed chunks straight into place).
  auto values = uninitialized(len);
  const size_t n_chunks = chunks_of(len, r.chunk);
  try {
    Frame f;
    for (size_t k = 0; k < n_chunks; ++k) {
      const size_t lo = k * r.chunk, m = std::min(r.chunk, static_cast<size_t>(len) - lo);
      const Deadline d = earliest(after(r.next_chunk), r.deadline);
      if (r.compression == Compression::kNone) {
        uint64_t index = 0;
        if (!c.receive_into(d, kMsgChunk, &index, 8, values.get() + lo, m * 4, f, 4096))
          throw NetError(NetError::Kind::kProtocol, "expected a chunk");
        if (index != k) throw NetError(NetError::Kind::kProtocol, "chunk out of order");
        continue;
      }
      f = c.receive(d, compressed_bytes(r.compression, m) + 8);
      if (f.type != kMsgChunk) throw NetError(NetError::Kind::kProtocol, "expected a chunk");
      Reader fr(f.payload);
      if (fr.u64() != k) throw NetError(NetError::Kind::kProtocol, "chunk out of order");
      if (!decompress(r.compression, fr.rest(), values.get() + lo, m))
        throw NetError(NetError::Kind::kProtocol, "chunk of the wrong size");
    }
  } catch (const NetError&) {
    fail();
    return;
  }
  std::unique_lock<std::mutex> lock(r.mu);
  if (r.averaged) {  // finished after the round's deadline: not part of the average
    s->state = Round::State::kFailed;
    lock.unlock();
    return refuse("your part arrived after the round ended");
  }
  s->values = std::move(values);
  s->state = Round::State::kComplete;
  r.cv.notify_all();
  // Wait for the average, then stream it (or the deltas) back.
  r.cv.wait_until(lock, r.deadline, [&] { return r.averaged; });
  if (!r.averaged) return;  // the owner gave up: the sender keeps its values
  lock.unlock();
  try {
    std::string payload;
    std::vector<float> delta;
    for (size_t k = 0; k < n_chunks; ++k) {
      const size_t lo = k * r.chunk, m = std::min(r.chunk, static_cast<size_t>(len) - lo);
      payload.clear();
      put_u64(payload, k);
      if (r.compression == Compression::kNone) {  // straight from the average
        c.send(kMsgResult, payload, {reinterpret_cast<const char*>(r.average.get() + lo), m * 4}, after(r.next_chunk));
        continue;
      } else {
        delta.resize(m);
        for (size_t i = 0; i < m; ++i) delta[i] = r.average[lo + i] - s->values[lo + i];
        compress(r.compression, delta.data(), m, payload);
      }
      c.send(kMsgResult, payload, after(r.next_chunk));
    }
  } catch (const NetError&) {
  }
  std::lock_guard<std::mutex> relock(r.mu);
  s->values.reset();
}

AllReduceReport Averager::allreduce(const Group& g, float* data, size_t n, double weight, const AllReduceOptions& o) {
  PT_CHECK(g.self < g.members.size(), "self ", g.self, " of ", g.members.size());
  PT_CHECK(weight >= 0.0 && std::isfinite(weight), "weight ", weight);
  PT_CHECK(g.group_id.size() <= kMaxGroupId && o.chunk_elements > 0, "group id or chunk size");
  const auto t0 = Clock::now();
  const Deadline deadline = t0 + o.allreduce_timeout;
  const std::vector<size_t> sizes = part_sizes(n, g);
  std::vector<size_t> offsets(sizes.size(), 0);
  for (size_t j = 1; j < sizes.size(); ++j) offsets[j] = offsets[j - 1] + sizes[j - 1];
  AllReduceReport report;

  // This peer's own part: register the round before anyone can stream to it.
  std::shared_ptr<Round> round;
  if (sizes[g.self] > 0) {
    round = std::make_shared<Round>();
    round->group_id = g.group_id;
    round->self = g.self;
    round->members = g.members.size();
    round->len = sizes[g.self];
    round->chunk = o.chunk_elements;
    round->compression = o.compression;
    round->deadline = deadline;
    round->first_contact = earliest(t0 + o.next_chunk_timeout, deadline);
    round->next_chunk = o.next_chunk_timeout;
    for (size_t i = 0; i < g.members.size(); ++i)
      if (i != g.self) round->senders[i];
    std::lock_guard<std::mutex> lock(mu_);
    rounds_[g.group_id] = round;
    cv_.notify_all();
  }

  // Stream every other part to its reducer; apply what comes back.
  struct Outgoing {
    std::thread thread;
    bool ok = false;
    uint64_t sent = 0, received = 0;
  };
  std::vector<Outgoing> out(g.members.size());
  for (size_t j = 0; j < g.members.size(); ++j) {
    if (j == g.self || sizes[j] == 0) continue;
    out[j].thread = std::thread([&, j] {
      const size_t len = sizes[j], off = offsets[j];
      std::unique_ptr<Connection> c;
      try {
        c = Connection::connect(g.members[j].address, earliest(after(o.next_chunk_timeout), deadline));
        std::string hello;
        put_str(hello, g.group_id);
        put_u32(hello, static_cast<uint32_t>(g.self));
        put_u32(hello, static_cast<uint32_t>(j));
        put_u64(hello, len);
        put_u32(hello, static_cast<uint32_t>(o.compression));
        put_f64(hello, weight);
        put_u64(hello, o.chunk_elements);
        c->send(kMsgAllReduceHello, hello, earliest(after(o.next_chunk_timeout), deadline));
        const size_t n_chunks = chunks_of(len, o.chunk_elements);
        std::string payload;
        for (size_t k = 0; k < n_chunks; ++k) {
          const size_t lo = k * o.chunk_elements, m = std::min(o.chunk_elements, len - lo);
          payload.clear();
          put_u64(payload, k);
          const Deadline d = earliest(after(o.next_chunk_timeout), deadline);
          if (o.compression == Compression::kNone) {  // straight from the caller's vector
            c->send(kMsgChunk, payload, {reinterpret_cast<const char*>(data + off + lo), m * 4}, d);
            continue;
          }
          compress(o.compression, data + off + lo, m, payload);
          c->send(kMsgChunk, payload, d);
        }
        // The result: the reducer answers once every member delivered (or the deadline).
        auto result = uninitialized(len);
        Frame f;
        for (size_t k = 0; k < n_chunks; ++k) {
          const size_t lo = k * o.chunk_elements, m = std::min(o.chunk_elements, len - lo);
          const Deadline d = k == 0 ? deadline : earliest(after(o.next_chunk_timeout), deadline);
          if (o.compression == Compression::kNone) {
            uint64_t index = 0;
            if (!c->receive_into(d, kMsgResult, &index, 8, result.get() + lo, m * 4, f, 4096))
              throw NetError(NetError::Kind::kProtocol, "refused: " + f.payload.substr(0, 200));
            if (index != k) throw NetError(NetError::Kind::kProtocol, "result chunk out of order");
            continue;
          }
          f = c->receive(d, compressed_bytes(o.compression, m) + 8 + 4096);
          if (f.type != kMsgResult) throw NetError(NetError::Kind::kProtocol, "refused: " + f.payload.substr(0, 200));
          Reader fr(f.payload);
          if (fr.u64() != k) throw NetError(NetError::Kind::kProtocol, "result chunk out of order");
          if (!decompress(o.compression, fr.rest(), result.get() + lo, m))
            throw NetError(NetError::Kind::kProtocol, "result chunk of the wrong size");
        }
        if (o.compression == Compression::kNone) {
          std::copy(result.get(), result.get() + len, data + off);
        } else {
          for (size_t i = 0; i < len; ++i) data[off + i] += result[i];
        }
        out[j].ok = true;
      } catch (const NetError&) {
      }
      if (c) out[j].sent = c->bytes_sent(), out[j].received = c->bytes_received();
    });
  }

  // Reduce this peer's own part once every sender delivered or failed (or time ran out).
  if (round) {
    Round& r = *round;
    std::unique_lock<std::mutex> lock(r.mu);
    auto settled = [&] {
      const auto now = Clock::now();
      for (auto& [i, s] : r.senders) {
        if (s.state == Round::State::kWaiting && now >= r.first_contact) s.state = Round::State::kFailed;
        if (s.state == Round::State::kWaiting || s.state == Round::State::kReceiving) return false;
      }
      return true;
    };
    while (!settled() && Clock::now() < deadline)  // every change of a sender's state notifies
      r.cv.wait_until(lock, Clock::now() < r.first_contact ? r.first_contact : deadline);
    const size_t off = offsets[g.self];
    double total = weight;
    size_t count = 1;
    std::vector<std::pair<double, const float*>> in;  // the senders that delivered all of it
    for (auto& [i, s] : r.senders) {
      if (s.state != Round::State::kComplete) {
        report.excluded_senders.push_back(g.members[i].peer_id);
        continue;
      }
      total += s.weight;
      ++count;
      in.emplace_back(s.weight, s.values.get());
    }
    // Nobody accumulated samples: the plain mean.
    const bool plain = !(total > 0);
    const double w0 = plain ? 1.0 : weight, divisor = plain ? static_cast<double>(count) : total;
    if (plain)
      for (auto& e : in) e.first = 1.0;
    r.average = uninitialized(r.len);
    float* avg = r.average.get();
    float* mine = data + off;
    // In blocks: each input streams once through memory, the sum stays in double, in sender
    // order, and no part-sized double accumulator is allocated.
    constexpr size_t kBlock = 2048;
    double acc[kBlock];
    for (size_t lo = 0; lo < r.len; lo += kBlock) {
      const size_t m = std::min(kBlock, r.len - lo);
      for (size_t k = 0; k < m; ++k) acc[k] = w0 * static_cast<double>(mine[lo + k]);
      for (const auto& [w, v] : in)
        for (size_t k = 0; k < m; ++k) acc[k] += w * static_cast<double>(v[lo + k]);
      for (size_t k = 0; k < m; ++k) mine[lo + k] = avg[lo + k] = static_cast<float>(acc[k] / divisor);
    }
    report.part_weight = total;
    r.averaged = true;
    r.cv.notify_all();
  }
  size_t local = 0;
  for (size_t j = 0; j < out.size(); ++j) {
    if (!out[j].thread.joinable()) continue;
    out[j].thread.join();
    report.bytes_sent += out[j].sent, report.bytes_received += out[j].received;
    if (!out[j].ok) report.failed_reducers.push_back(g.members[j].peer_id), local += sizes[j];
  }
  report.local_fraction = n ? static_cast<double>(local) / static_cast<double>(n) : 0.0;
  if (round) {
    std::lock_guard<std::mutex> lock(mu_);
    rounds_.erase(g.group_id);
  }
  report.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return report;
}

void Router::on(uint8_t type, Service s) {
  std::lock_guard<std::mutex> lock(mu_);
  services_[type] = std::move(s);
}

Server::Handler Router::handler(std::chrono::milliseconds first_frame) {
  return [this, first_frame](Connection& c) {
    Frame f = c.receive(after(first_frame), 64 * 1024);
    Service s;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = services_.find(f.type);
      if (it == services_.end()) return;
      s = it->second;
    }
    s(c, f);
  };
}

AveragingPeer::AveragingPeer(bool client, const std::string& listen) {
  router.on(kMsgAllReduceHello, [this](Connection& c, const Frame& f) { averager.handle(c, f); });
  if (!client) server = std::make_unique<Server>(listen, router.handler());
}

}  // namespace polytrain::hivemind
