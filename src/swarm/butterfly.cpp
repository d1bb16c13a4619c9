#include "polytrain/swarm/butterfly.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <sstream>
#include <thread>

#include "polytrain/common/error.h"
#include "polytrain/swarm/group_auth.h"

namespace polytrain::hivemind {
namespace {

constexpr size_t kMaxGroupId = 256;
constexpr size_t kMaxElements = size_t{1} << 34;

size_t chunks_of(size_t len, size_t chunk) { return (len + chunk - 1) / chunk; }

// The hello's compression field, with AllReduceOptions::same_result in a high bit: a member and a
// reducer that disagree on either are refused like any other mismatch.
uint32_t hello_compression(Compression c, bool same_result) {
  return static_cast<uint32_t>(c) | (same_result ? uint32_t{1} << 16 : 0);
}

Deadline earliest(Deadline a, Deadline b) { return std::min(a, b); }

// Every element is written before it is read: no zero-filling pass over part-sized buffers.
std::unique_ptr<float[]> uninitialized(size_t n) { return std::unique_ptr<float[]>(new float[std::max<size_t>(n, 1)]); }

// Whether all n values are finite: no exponent of all ones (NaN, infinity). An integer OR
// over the bits, which the compiler vectorises (a float sum would keep its order, scalar).
bool all_finite(const float* v, size_t n) {
  uint32_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, v + i, sizeof b);
    bad |= static_cast<uint32_t>((b & 0x7f800000u) == 0x7f800000u);
  }
  return bad == 0;
}

// mine[i] = (w0 mine[i] + w1 v1[i] + w2 v2[i] + ...) / divisor, the sum in double in sender
// order. One input (two members) runs as one fused loop, memory-bound; more in blocks, each
// input streaming once through memory with no part-sized accumulator.
void weighted_mean(float* __restrict mine, size_t n, double w0, const std::vector<std::pair<double, const float*>>& in,
                   double divisor) {
  if (in.empty()) {
    for (size_t k = 0; k < n; ++k) mine[k] = static_cast<float>(w0 * static_cast<double>(mine[k]) / divisor);
    return;
  }
  const double w1 = in[0].first;
  const float* __restrict v1 = in[0].second;
  if (in.size() == 1) {
    for (size_t k = 0; k < n; ++k)
      mine[k] = static_cast<float>((w0 * static_cast<double>(mine[k]) + w1 * static_cast<double>(v1[k])) / divisor);
    return;
  }
  constexpr size_t kBlock = 2048;
  alignas(64) double acc[kBlock];
  for (size_t lo = 0; lo < n; lo += kBlock) {
    const size_t m = std::min(kBlock, n - lo);
    float* __restrict out = mine + lo;
    const float* __restrict first = v1 + lo;
    for (size_t k = 0; k < m; ++k) acc[k] = w0 * static_cast<double>(out[k]) + w1 * static_cast<double>(first[k]);
    for (size_t j = 1; j < in.size(); ++j) {
      const double w = in[j].first;
      const float* __restrict v = in[j].second + lo;
      for (size_t k = 0; k < m; ++k) acc[k] += w * static_cast<double>(v[k]);
    }
    for (size_t k = 0; k < m; ++k) out[k] = static_cast<float>(acc[k] / divisor);
  }
}

}  // namespace

std::string AllReduceReport::warning() const {
  if (failed_reducers.empty() && excluded_senders.empty() && rejected_senders.empty() && clipped_senders.empty() &&
      clamped_senders.empty() && unsigned_hellos == 0 && banned_members.empty() && newly_banned.empty())
    return "";
  std::ostringstream os;
  if (!failed_reducers.empty()) {
    os << "averaging: " << failed_reducers.size() << " reducer(s) failed, " << std::fixed;
    os.precision(1);
    os << 100.0 * local_fraction << "% of the vector kept its local values";
  }
  if (!excluded_senders.empty())
    os << (failed_reducers.empty() ? "averaging: " : "; ") << excluded_senders.size()
       << " sender(s) excluded from this peer's part";
  if (!rejected_senders.empty()) {
    os << (failed_reducers.empty() && excluded_senders.empty() ? "averaging: " : "; ")
       << "left out for non-finite values or a weight out of bounds:";
    for (const auto& id : rejected_senders) os << ' ' << id;
  }
  auto names = [&](const char* what, const std::vector<std::string>& ids) {
    if (ids.empty()) return;
    os << (os.tellp() > 0 ? "; " : "averaging: ") << what << ':';
    for (const auto& id : ids) os << ' ' << id;
  };
  names("clipped by more than half its norm (centered_clip)", clipped_senders);
  names("weight cut to its signed progress", clamped_senders);
  if (unsigned_hellos > 0)
    os << (os.tellp() > 0 ? "; " : "averaging: ") << unsigned_hellos
       << " stream(s) refused: not signed by the member whose index they claimed";
  names("banned earlier, left out", banned_members);
  names("banned from later groups after repeated offences", newly_banned);
  return os.str();
}

std::vector<size_t> part_sizes(size_t n, const Group& g) {
  std::vector<double> bw(g.members.size(), 0.0);
  for (size_t i = 0; i < bw.size(); ++i)
    if (!g.members[i].address.empty() && g.members[i].bandwidth > 0 && std::isfinite(g.members[i].bandwidth))
      bw[i] = std::min(g.members[i].bandwidth, kMaxDeclaredBandwidth);
  // No reducer above kMaxBandwidthRatio x the median reducer (the lower median: the same on
  // every member, and a lone huge claim never is it).
  std::vector<double> positive;
  for (double b : bw)
    if (b > 0) positive.push_back(b);
  if (!positive.empty()) {
    std::nth_element(positive.begin(), positive.begin() + (positive.size() - 1) / 2, positive.end());
    const double cap = kMaxBandwidthRatio * positive[(positive.size() - 1) / 2];
    for (double& b : bw) b = std::min(b, cap);
  }
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
  /// The members' peer ids, when hellos must be signed by the member whose index they claim.
  std::vector<std::string> signers;
  size_t unsigned_hellos = 0;  // refused for a missing or wrong signature
  Compression compression = Compression::kNone;
  /// AllReduceOptions::same_result: the average's compressed chunks, encoded once by the owner;
  /// every stream sends these bytes and the owner's part holds their decoded values.
  bool same_result = false;
  std::vector<std::string> result_chunks;
  Deadline deadline, first_contact;
  std::chrono::milliseconds next_chunk{0};
  std::mutex mu;
  std::condition_variable cv;
  std::map<size_t, Sender> senders;  // every member but self
  bool averaged = false;
  // The average is written over the owner's own part of its vector; the streams that send it
  // back read it there, so the owner's allreduce() returns only once none is left
  // (results_pending, counted when `averaged` is set; each stream ends by the deadline).
  const float* average = nullptr;
  size_t results_pending = 0;
  uint64_t served_sent = 0, served_received = 0;  // the bytes of the streams that got the result
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
  const std::string_view signed_part = std::string_view(hello.payload).substr(0, hello.payload.size() - rd.rest().size());
  const std::string signature = rd.done() ? std::string() : rd.str(64);
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
  // Before the sender's slot is looked at: a stream that cannot sign for the index it claims
  // takes no slot, so the member that owns the index still gets it.
  if (!r.signers.empty() && (sender >= r.signers.size() || !rd.done() ||
                             !hello_signed_by(r.signers[sender], r.signers[r.self], signed_part, signature))) {
    {
      std::lock_guard<std::mutex> lock(r.mu);
      ++r.unsigned_hellos;
    }
    return refuse("hello not signed by the member whose index it claims");
  }
  if (part != r.self || len != r.len || comp != hello_compression(r.compression, r.same_result) || chunk != r.chunk ||
      !(weight >= 0.0 && weight < 1e15) || len > kMaxElements)  // the reducer checks the weight's real bound
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
  if (!r.averaged) {  // the owner gave up: the sender keeps its values (and is not counted)
    s->state = Round::State::kFailed;
    s->values.reset();
    return;
  }
  lock.unlock();
  struct Done {  // the owner's vector is not read after this
    Round& r;
    Connection& c;
    ~Done() {
      std::lock_guard<std::mutex> lock(r.mu);
      r.served_sent += c.bytes_sent(), r.served_received += c.bytes_received();
      --r.results_pending;
      r.cv.notify_all();
    }
  } done{r, c};
  try {
    std::string payload;
    std::vector<float> delta;
    for (size_t k = 0; k < n_chunks; ++k) {
      const size_t lo = k * r.chunk, m = std::min(r.chunk, static_cast<size_t>(len) - lo);
      const Deadline until = earliest(after(r.next_chunk), r.deadline);
      payload.clear();
      put_u64(payload, k);
      if (r.compression == Compression::kNone) {  // straight from the average
        c.send(kMsgResult, payload, {reinterpret_cast<const char*>(r.average + lo), m * 4}, until);
        continue;
      } else if (r.same_result) {
        payload += r.result_chunks[k];
      } else {
        delta.resize(m);
        for (size_t i = 0; i < m; ++i) delta[i] = r.average[lo + i] - s->values[lo + i];
        compress(r.compression, delta.data(), m, payload);
      }
      c.send(kMsgResult, payload, until);
    }
  } catch (const NetError&) {
  }
  std::lock_guard<std::mutex> relock(r.mu);
  s->values.reset();
}

namespace {

/// One stream of allreduce() to the reducer of another member's part.
struct Outgoing {
  std::thread thread;
  bool ok = false;
  size_t kept = 0;  // elements of the part the result has not replaced
  uint64_t sent = 0, received = 0;
};

/// What the phases of one allreduce() share: the group, the caller's vector and its weight, the
/// options, the round's deadline and the parts the vector is cut into.
struct AllReduceCall {
  const Group& g;
  float* data;
  size_t n;
  double weight;
  const AllReduceOptions& o;
  Deadline deadline;
  const std::vector<size_t>& sizes;
  const std::vector<size_t>& offsets;
};

/// Sends part j to its reducer: the hello, then the part, chunk by chunk.
void send_part(Connection& c, const AllReduceCall& p, size_t j) {
  const Group& g = p.g;
  const AllReduceOptions& o = p.o;
  const Deadline deadline = p.deadline;
  const float* data = p.data;
  const size_t len = p.sizes[j], off = p.offsets[j];
  std::string hello;
  put_str(hello, g.group_id);
  put_u32(hello, static_cast<uint32_t>(g.self));
  put_u32(hello, static_cast<uint32_t>(j));
  put_u64(hello, len);
  put_u32(hello, hello_compression(o.compression, o.same_result));
  put_f64(hello, p.weight);
  put_u64(hello, o.chunk_elements);
  if (g.identity) put_str(hello, sign_hello(*g.identity, g.members[j].peer_id, hello));
  c.send(kMsgAllReduceHello, hello, earliest(after(o.next_chunk_timeout), deadline));
  const size_t n_chunks = chunks_of(len, o.chunk_elements);
  std::string payload;
  for (size_t k = 0; k < n_chunks; ++k) {
    const size_t lo = k * o.chunk_elements, m = std::min(o.chunk_elements, len - lo);
    payload.clear();
    put_u64(payload, k);
    const Deadline d = earliest(after(o.next_chunk_timeout), deadline);
    if (o.compression == Compression::kNone) {  // straight from the caller's vector
      c.send(kMsgChunk, payload, {reinterpret_cast<const char*>(data + off + lo), m * 4}, d);
      continue;
    }
    compress(o.compression, data + off + lo, m, payload);
    c.send(kMsgChunk, payload, d);
  }
}

/// Receives the reducer's result for part j and applies it to the caller's vector, chunk by chunk.
void receive_result(Connection& c, const AllReduceCall& p, size_t j, Outgoing& out) {
  const AllReduceOptions& o = p.o;
  const Deadline deadline = p.deadline;
  float* data = p.data;
  const size_t len = p.sizes[j], off = p.offsets[j];
  const size_t n_chunks = chunks_of(len, o.chunk_elements);
  // The result, once every member delivered to the reducer (or its deadline): each
  // chunk lands in a chunk-sized buffer and enters the vector only whole, so a stream
  // that breaks leaves every element either averaged or as it was (out.kept counts
  // the latter).
  auto result = uninitialized(std::min(o.chunk_elements, len));
  Frame f;
  for (size_t k = 0; k < n_chunks; ++k) {
    const size_t lo = k * o.chunk_elements, m = std::min(o.chunk_elements, len - lo);
    const Deadline d = k == 0 ? deadline : earliest(after(o.next_chunk_timeout), deadline);
    if (o.compression == Compression::kNone) {
      uint64_t index = 0;
      if (!c.receive_into(d, kMsgResult, &index, 8, result.get(), m * 4, f, 4096))
        throw NetError(NetError::Kind::kProtocol, "refused: " + f.payload.substr(0, 200));
      if (index != k) throw NetError(NetError::Kind::kProtocol, "result chunk out of order");
      if (!all_finite(result.get(), m)) throw NetError(NetError::Kind::kProtocol, "non-finite result");
      std::copy(result.get(), result.get() + m, data + off + lo);
    } else {
      f = c.receive(d, compressed_bytes(o.compression, m) + 8 + 4096);
      if (f.type != kMsgResult) throw NetError(NetError::Kind::kProtocol, "refused: " + f.payload.substr(0, 200));
      Reader fr(f.payload);
      if (fr.u64() != k) throw NetError(NetError::Kind::kProtocol, "result chunk out of order");
      if (!decompress(o.compression, fr.rest(), result.get(), m))
        throw NetError(NetError::Kind::kProtocol, "result chunk of the wrong size");
      if (!all_finite(result.get(), m)) throw NetError(NetError::Kind::kProtocol, "non-finite result");
      if (o.same_result) std::copy(result.get(), result.get() + m, data + off + lo);  // the average itself
      else for (size_t i = 0; i < m; ++i) data[off + lo + i] += result[i];  // the average minus what was sent
    }
    out.kept -= m;
  }
}

/// The thread of part j: streams it to its reducer and applies what comes back; a failure leaves `out.ok` false.
void stream_part(const AllReduceCall& p, size_t j, Outgoing& out) {
  std::unique_ptr<Connection> c;
  try {
    c = Connection::connect(p.g.members[j].address, earliest(after(p.o.next_chunk_timeout), p.deadline));
    send_part(*c, p, j);
    receive_result(*c, p, j, out);
    out.ok = true;
  } catch (const NetError&) {
  }
  if (c) out.sent = c->bytes_sent(), out.received = c->bytes_received();
}

// Whether a contribution may enter a part: every value finite, and a weight (a count of
// samples) within the round's bound (a step's samples are bounded by the swarm's target batch).
bool acceptable(const AllReduceOptions& o, double w, const float* v, size_t n) {
  return w <= o.max_weight && all_finite(v, n);
}

// A weight cut to what the sender's signed progress says it accumulated (where the caller knows
// it); names the sender when it was cut. Clamped rather than left out: a reducer reads those
// records a little late, so an honest sender's last micro-batch may be missing from them, and
// its work should not be lost (nor counted as an offence) for that.
double bounded_weight(const AllReduceOptions& o, const std::string& peer, double w, AllReduceReport* report) {
  if (!o.sender_max_weight) return w;
  const double bound = o.sender_max_weight(peer);
  if (!(w > bound)) return w;
  report->clamped_senders.push_back(peer);
  return std::max(bound, 0.0);
}

/// The contributions a reducer combines: this peer's own part first (if it counts), then the
/// senders in index order, with the member index of each.
struct PartInputs {
  bool self_in = false;
  double self_weight = 0.0;
  std::vector<std::pair<double, const float*>> in;  // the senders' (weight, values)
  std::vector<size_t> members;                        // member index of each of `in`
  double total = 0.0;
  size_t delivered = 0;  // senders that delivered all of it, the rejected ones too
};

// Callers pass other members only: a peer does not ban itself for its own bad part.
void count_offence(Offences& offences, const std::string& peer, AllReduceReport* report) {
  if (offences.record(peer)) report->newly_banned.push_back(peer);
}

PartInputs gather_inputs(Averager::Round& r, const AllReduceCall& p, Offences& offences, AllReduceReport* report) {
  using Round = Averager::Round;
  const Group& g = p.g;
  PartInputs pi;
  // A contribution with a non-finite value or a weight out of bounds is left out (this peer's
  // own too): one member's NaN or 1e15 samples no longer reach the whole group. An auxiliary
  // peer's own values are not a contribution: they are never read.
  const bool auxiliary = g.members[g.self].auxiliary;
  pi.self_in = !auxiliary && acceptable(p.o, p.weight, p.data + p.offsets[g.self], r.len);
  if (!auxiliary && !pi.self_in) report->rejected_senders.push_back(g.members[g.self].peer_id);
  pi.self_weight = pi.self_in ? bounded_weight(p.o, g.members[g.self].peer_id, p.weight, report) : 0.0;
  pi.total = pi.self_weight;
  for (auto& [i, s] : r.senders) {
    const std::string& id = g.members[i].peer_id;
    if (s.state != Round::State::kComplete) {
      report->excluded_senders.push_back(id);
      continue;
    }
    ++pi.delivered;
    if (!acceptable(p.o, s.weight, s.values.get(), r.len)) {
      report->rejected_senders.push_back(id);  // still gets the average back
      count_offence(offences, id, report);
      continue;
    }
    const double w = bounded_weight(p.o, id, s.weight, report);
    pi.total += w;
    pi.in.emplace_back(w, s.values.get());
    pi.members.push_back(i);
  }
  return pi;
}

// CenteredClip over the part's inputs into `mine`; names the contributions scaled by less than
// one half. Those count as offences only while they are a minority of the part: a tau too small
// for the swarm's honest spread clips everyone, and must not ban the swarm.
void clip_part(float* mine, size_t len, const AllReduceCall& p, const PartInputs& pi, bool plain, Offences& offences,
               AllReduceReport* report) {
  std::vector<Contribution> all;
  std::vector<size_t> who;
  if (pi.self_in) all.push_back({plain ? 1.0 : pi.self_weight, mine}), who.push_back(p.g.self);
  for (size_t k = 0; k < pi.in.size(); ++k)
    all.push_back({plain ? 1.0 : pi.in[k].first, pi.in[k].second}), who.push_back(pi.members[k]);
  const auto res = centered_clip(all, len, p.o.centered_clip_tau, p.o.centered_clip_iterations, mine);
  std::vector<size_t> clipped;
  for (size_t k = 0; k < all.size(); ++k)
    if (res.kept[k] < 0.5) clipped.push_back(who[k]);
  for (size_t i : clipped) {
    report->clipped_senders.push_back(p.g.members[i].peer_id);
    if (2 * clipped.size() < all.size() && i != p.g.self) count_offence(offences, p.g.members[i].peer_id, report);
  }
}

/// same_result: the average compressed once, chunk by chunk as the streams send it, and this
/// peer's part replaced by what the members decode from those bytes.
void encode_result(Averager::Round& r, float* mine) {
  const size_t n_chunks = chunks_of(r.len, r.chunk);
  r.result_chunks.assign(n_chunks, std::string());
  for (size_t k = 0; k < n_chunks; ++k) {
    const size_t lo = k * r.chunk, m = std::min(r.chunk, r.len - lo);
    compress(r.compression, mine + lo, m, r.result_chunks[k]);
    // A non-finite average fails to decode here and at every member, which refuse its chunk.
    (void)decompress(r.compression, r.result_chunks[k], mine + lo, m);
  }
}

/// Averages this peer's own part over the senders that delivered it and hands it to the streams that send it back.
void reduce_own_part(Averager::Round& r, const AllReduceCall& p, Offences& offences, AllReduceReport* report) {
  using Round = Averager::Round;
  const Group& g = p.g;
  const Deadline deadline = p.deadline;
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
  float* mine = p.data + p.offsets[g.self];
  PartInputs pi = gather_inputs(r, p, offences, report);
  const size_t count = pi.in.size() + (pi.self_in ? 1 : 0);
  // Nobody accumulated samples: the plain mean.
  const bool plain = !(pi.total > 0);
  const double w0 = !pi.self_in ? 0.0 : plain ? 1.0 : pi.self_weight, divisor = plain ? static_cast<double>(count) : pi.total;
  if (count > 0 && p.o.aggregation == Aggregation::kCenteredClip) {
    clip_part(mine, r.len, p, pi, plain, offences, report);
  } else if (count > 0) {  // else nothing acceptable, not even this peer's own: the part keeps its values
    if (plain)
      for (auto& e : pi.in) e.first = 1.0;
    if (!pi.self_in) std::fill(mine, mine + r.len, 0.0f);  // weight 0, and 0 x NaN would be NaN
    weighted_mean(mine, r.len, w0, pi.in, divisor);
  }
  if (r.same_result && r.compression != Compression::kNone) encode_result(r, mine);
  report->part_weight = pi.total;
  report->part_elements = r.len;
  report->part_senders = count;
  r.average = mine;
  r.results_pending = pi.delivered;  // every stream that delivered streams the result back
  r.averaged = true;
  r.cv.notify_all();
}

/// Joins the streams to the other parts' reducers and reports their bytes, the failed reducers and the local fraction.
void join_streams(const AllReduceCall& p, std::vector<Outgoing>& out, AllReduceReport* report) {
  size_t local = 0;
  for (size_t j = 0; j < out.size(); ++j) {
    if (!out[j].thread.joinable()) continue;
    out[j].thread.join();
    report->bytes_sent += out[j].sent, report->bytes_received += out[j].received;
    if (!out[j].ok) report->failed_reducers.push_back(p.g.members[j].peer_id), local += out[j].kept;
  }
  report->local_fraction = p.n ? static_cast<double>(local) / static_cast<double>(p.n) : 0.0;
}

}  // namespace

std::shared_ptr<Averager::Round> Averager::register_round(const Group& g, size_t len, const AllReduceOptions& o,
                                                          Clock::time_point t0, Deadline deadline) {
  auto round = std::make_shared<Round>();
  round->group_id = g.group_id;
  round->self = g.self;
  round->members = g.members.size();
  round->len = len;
  round->chunk = o.chunk_elements;
  round->compression = o.compression;
  round->same_result = o.same_result;
  round->deadline = deadline;
  round->first_contact = earliest(t0 + o.next_chunk_timeout, deadline);
  round->next_chunk = o.next_chunk_timeout;
  if (g.identity)
    for (const auto& m : g.members) round->signers.push_back(m.peer_id);
  for (size_t i = 0; i < g.members.size(); ++i)
    // An auxiliary member sends nothing; a banned one is not waited for (its hello is refused).
    if (i != g.self && !g.members[i].auxiliary && !offences_.banned(g.members[i].peer_id)) round->senders[i];
  std::lock_guard<std::mutex> lock(mu_);
  rounds_[g.group_id] = round;
  cv_.notify_all();
  return round;
}

void Averager::release_round(const std::string& group_id, Round& round) {
  {
    // The streams still sending the average read it from `data`.
    std::unique_lock<std::mutex> lock(round.mu);
    round.cv.wait(lock, [&] { return round.results_pending == 0; });
  }
  std::lock_guard<std::mutex> lock(mu_);
  rounds_.erase(group_id);
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
  const AllReduceCall call{g, data, n, weight, o, deadline, sizes, offsets};
  AllReduceReport report;

  // This peer's own part: register the round before anyone can stream to it.
  std::shared_ptr<Round> round;
  if (sizes[g.self] > 0) round = register_round(g, sizes[g.self], o, t0, deadline);

  // Stream every other part to its reducer; apply what comes back (an auxiliary peer has no
  // vector of its own to send).
  std::vector<Outgoing> out(g.members.size());
  size_t banned_part = 0;  // a banned reducer is sent nothing: its part stays local
  for (size_t j = 0; j < g.members.size(); ++j) {
    if (j != g.self && offences_.banned(g.members[j].peer_id)) report.banned_members.push_back(g.members[j].peer_id);
    if (j == g.self || sizes[j] == 0 || g.members[g.self].auxiliary) continue;
    if (offences_.banned(g.members[j].peer_id)) {
      banned_part += sizes[j];
      continue;
    }
    out[j].kept = sizes[j];
    out[j].thread = std::thread([&, j] { stream_part(call, j, out[j]); });
  }

  // Reduce this peer's own part once every sender delivered or failed (or time ran out).
  if (round) reduce_own_part(*round, call, offences_, &report);
  join_streams(call, out, &report);
  if (n > 0) report.local_fraction += static_cast<double>(banned_part) / static_cast<double>(n);
  if (round) {
    release_round(g.group_id, *round);
    std::lock_guard<std::mutex> lock(round->mu);  // the bytes of serving this peer's own part
    report.bytes_sent += round->served_sent, report.bytes_received += round->served_received;
    report.unsigned_hellos = round->unsigned_hellos;
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

namespace {
// HOST of HOST:PORT or [HOST]:PORT ("" when there is no port).
std::string host_of(const std::string& host_port) {
  const auto colon = host_port.rfind(':');
  if (colon == std::string::npos) return "";
  std::string h = host_port.substr(0, colon);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  return h;
}
}  // namespace

void serve_dial_back(Router& router) {
  router.on(kMsgDialBack, [](Connection& c, const Frame& f) {
    std::string answer = "-";  // not an address on the requester's IP: not dialled
    const std::string host = host_of(f.payload);
    if (!host.empty() && f.payload.size() <= 300 && host == host_of(c.remote())) {
      try {
        Connection::connect(f.payload, after(std::chrono::milliseconds(1000)));
        answer = "1";
      } catch (const NetError&) {
        answer = "0";
      }
    }
    try {
      c.send(kMsgDialBackReply, answer, after(std::chrono::milliseconds(1000)));
    } catch (const NetError&) {
    }
  });
}

std::optional<bool> ask_dial_back(const std::string& helper, const std::string& address, Deadline deadline) {
  try {
    auto c = Connection::connect(helper, deadline);
    c->send(kMsgDialBack, address, deadline);
    const Frame r = c->receive(deadline, 16);
    if (r.type != kMsgDialBackReply || (r.payload != "0" && r.payload != "1")) return std::nullopt;  // "-": not dialled
    return r.payload == "1";
  } catch (const NetError&) {
    return std::nullopt;
  }
}

AveragingPeer::AveragingPeer(bool client, const std::string& listen) {
  router.on(kMsgAllReduceHello, [this](Connection& c, const Frame& f) { averager.handle(c, f); });
  if (!client) server = std::make_unique<Server>(listen, router.handler());
}

}  // namespace polytrain::hivemind
