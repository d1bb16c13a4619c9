#include "polytrain/swarm/state.h"

#include <sodium.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <tuple>

#include "polytrain/common/crc32c.h"
#include "polytrain/common/error.h"
#include "polytrain/swarm/dht.h"
#include "polytrain/swarm/record.h"

namespace polytrain::hivemind {
namespace {

constexpr size_t kMaxAddress = 256, kMaxReason = 512;
constexpr size_t kMaxChunk = size_t{16} << 20;
constexpr std::chrono::milliseconds kDonorIdle{30'000};  // a requester silent this long is dropped

std::string digest_str(const Digest& d) { return std::string(reinterpret_cast<const char*>(d.data()), d.size()); }

bool digest_from(const std::string& s, Digest& out) {
  if (s.size() != out.size()) return false;
  std::memcpy(out.data(), s.data(), out.size());
  return true;
}

// A chunk's checksum catches a stream that corrupts bytes (CRC-32C, hardware-fast: a 100 MB
// state is checked at memory speed). It is not what makes a state trustworthy: the whole state
// is checked against the BLAKE2b digest its donors announced in signed records.
constexpr size_t kChunkSum = 4;
std::string chunk_digest(std::string_view data) {
  std::string out;
  put_u32(out, crc32c(data.data(), data.size()));
  return out;
}

std::string short_id(const std::string& id) { return id.substr(0, 8); }

}  // namespace

Digest digest32(std::string_view data) {
  Digest out{};
  crypto_generichash(out.data(), out.size(), reinterpret_cast<const unsigned char*>(data.data()), data.size(),
                     nullptr, 0);
  return out;
}

namespace {
constexpr std::string_view kStateMagic = "polytrain-peer-state-1\n";

bool get_u64(std::string_view& in, uint64_t& v) {
  if (in.size() < 8) return false;
  v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(in[i])) << (8 * i);
  in.remove_prefix(8);
  return true;
}

bool get_bytes(std::string_view& in, std::string& out) {
  uint64_t n = 0;
  if (!get_u64(in, n) || n > in.size()) return false;
  out.assign(in.data(), n);
  in.remove_prefix(n);
  return true;
}
}  // namespace

std::string pack_peer_state(const PeerState& s) {
  std::string out;
  out.reserve(kStateMagic.size() + 32 + s.model.size() + s.optimizer.size() + s.config.size());
  out.append(kStateMagic);
  put_u64(out, static_cast<uint64_t>(s.epoch));
  for (const std::string* part : {&s.model, &s.optimizer, &s.config}) {
    put_u64(out, part->size());
    out.append(*part);
  }
  return out;
}

std::optional<PeerState> unpack_peer_state(std::string_view in) {
  if (in.substr(0, kStateMagic.size()) != kStateMagic) return std::nullopt;
  in.remove_prefix(kStateMagic.size());
  PeerState s;
  uint64_t epoch = 0;
  if (!get_u64(in, epoch) || epoch > (uint64_t{1} << 62)) return std::nullopt;
  s.epoch = static_cast<int64_t>(epoch);
  if (!get_bytes(in, s.model) || !get_bytes(in, s.optimizer) || !get_bytes(in, s.config) || !in.empty()) return std::nullopt;
  return s;
}

std::string encode_donor(const DonorInfo& d) {
  std::string s;
  put_str(s, d.address);
  put_u64(s, static_cast<uint64_t>(d.epoch));
  return s;
}

std::optional<DonorInfo> decode_donor(const std::string& payload) {
  try {
    Reader rd(payload);
    DonorInfo d;
    d.address = rd.str(kMaxAddress);
    d.epoch = static_cast<int64_t>(rd.u64());
    if (!rd.done() || d.address.empty() || d.epoch < 0) return std::nullopt;
    return d;
  } catch (const NetError&) {
    return std::nullopt;
  }
}

std::string encode_manifest(const DonorInfo& d) {
  std::string s;
  put_u64(s, static_cast<uint64_t>(d.epoch));
  put_u64(s, d.size);
  put_str(s, digest_str(d.digest));
  return s;
}

std::optional<DonorInfo> decode_manifest(const std::string& payload) {
  try {
    Reader rd(payload);
    DonorInfo d;
    d.epoch = static_cast<int64_t>(rd.u64());
    d.size = rd.u64();
    if (!digest_from(rd.str(32), d.digest) || !rd.done() || d.epoch < 0 || d.size == 0) return std::nullopt;
    return d;
  } catch (const NetError&) {
    return std::nullopt;
  }
}

// ---------------------------------------------------------------------------------------------
// Donor

StateDonor::StateDonor(DhtNode* dht, Router& router, std::string key, std::string address,
                       std::chrono::milliseconds ttl)
    : dht_(dht), key_(std::move(key)), address_(std::move(address)), ttl_(ttl) {
  if (dht_) peer_id_ = dht_->identity().peer_id();
  router.on(kMsgStateRequest, [this](Connection& c, const Frame& f) { serve(c, f); });
  router.on(kMsgStateManifest, [this](Connection& c, const Frame& f) { serve(c, f); });
}

StateDonor::~StateDonor() {
  // The router outlives nothing here: the owner stops its server (which joins the streams)
  // before destroying the donor. An announcement in flight ends within its store timeout.
  if (announcer_.joinable()) announcer_.join();
}

void StateDonor::set_provider(Provider p) {
  std::lock_guard<std::mutex> lock(provide_mu_);
  provider_ = std::move(p);
}

void StateDonor::install(std::shared_ptr<StateSnapshot> s) {
  s->digest = digest32(s->bytes);
  std::lock_guard<std::mutex> lock(mu_);
  previous_ = std::move(current_);
  current_ = std::move(s);
}

void StateDonor::publish(int64_t epoch, std::string bytes) {
  auto s = std::make_shared<StateSnapshot>();
  s->epoch = epoch;
  s->bytes = std::move(bytes);
  install(std::move(s));
}

std::shared_ptr<const StateSnapshot> StateDonor::snapshot_for(int64_t min_epoch) {
  // The newest state this peer has: at least the epoch it last announced. An epoch beyond that
  // one cannot be satisfied, and is refused before the provider runs: it snapshots under the
  // lock the peer's step takes, so anyone could otherwise stall a donor's training at will.
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (announced_epoch_ >= 0 && min_epoch > announced_epoch_) return nullptr;
    min_epoch = std::max(min_epoch, announced_epoch_);
    if (current_ && current_->epoch >= min_epoch) return current_;
  }
  std::lock_guard<std::mutex> making(provide_mu_);  // newcomers asking at once share one snapshot
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (current_ && current_->epoch >= min_epoch) return current_;
  }
  if (!provider_) return nullptr;
  auto s = std::make_shared<StateSnapshot>(provider_());
  if (s->bytes.empty() || s->epoch < min_epoch) return nullptr;
  install(s);
  std::lock_guard<std::mutex> lock(mu_);
  ++made_;
  return s;
}

void StateDonor::announce(int64_t epoch) {
  const auto now = Clock::now();
  {
    // The record (a blocking DHT store) is refreshed every half lifetime, not every step: its
    // epoch is a hint, and a manifest always describes the donor's newest state.
    std::lock_guard<std::mutex> lock(mu_);
    const bool fresh = announced_at_ != Clock::time_point{} && now - announced_at_ < ttl_ / 2;
    announced_epoch_ = epoch;
    if (!dht_ || fresh || announcing_) return;
    announced_at_ = now;
    announcing_ = true;
  }
  if (announcer_.joinable()) announcer_.join();  // the previous store has finished (announcing_ was false)
  DonorInfo d;
  d.address = address_;
  d.epoch = epoch;
  announcer_ = std::thread([this, d] {
    dht_->store(key_, "donor", encode_donor(d), ttl_, std::chrono::milliseconds(2'000));
    std::lock_guard<std::mutex> lock(mu_);
    announcing_ = false;
  });
}

uint64_t StateDonor::snapshots_made() const {
  std::lock_guard<std::mutex> lock(mu_);
  return made_;
}

DonorInfo StateDonor::info() const {
  std::lock_guard<std::mutex> lock(mu_);
  DonorInfo d;
  d.peer_id = peer_id_;
  d.address = address_;
  if (current_) d.epoch = current_->epoch, d.size = current_->bytes.size(), d.digest = current_->digest;
  return d;
}

uint64_t StateDonor::bytes_served() const {
  std::lock_guard<std::mutex> lock(mu_);
  return served_;
}

size_t StateDonor::serving() const {
  std::lock_guard<std::mutex> lock(mu_);
  return serving_;
}

void StateDonor::corrupt_after(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  corrupt_after_ = bytes;
}

void StateDonor::die_after(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  die_after_ = bytes;
}

void StateDonor::serve(Connection& c, const Frame& first) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++serving_;
  }
  struct Done {
    StateDonor* d;
    ~Done() {
      std::lock_guard<std::mutex> lock(d->mu_);
      --d->serving_;
    }
  } done{this};
  Frame f = first;
  for (;;) {
    if (f.type == kMsgStateManifest) {
      // [min epoch] -> the manifest of a snapshot at that epoch or later (made now if needed).
      Reader rd(f.payload);
      const int64_t min_epoch = static_cast<int64_t>(rd.u64());
      const auto snap = snapshot_for(min_epoch);
      if (!snap) {
        std::string p;
        put_str(p, "has no state at epoch " + std::to_string(min_epoch) + " or later");
        c.send(kMsgStateRefuse, p, after(kDonorIdle));
        return;
      }
      DonorInfo m;
      m.epoch = snap->epoch, m.size = snap->bytes.size(), m.digest = snap->digest;
      c.send(kMsgStateManifest, encode_manifest(m), after(kDonorIdle));
      f = c.receive(after(kDonorIdle), 1024);
      continue;
    }
    // One range: [digest][offset][length][chunk bytes]; answered by chunks covering it.
    Reader rd(f.payload);
    Digest want{};
    if (f.type != kMsgStateRequest || !digest_from(rd.str(32), want)) return;
    const uint64_t offset = rd.u64(), length = rd.u64();
    const uint32_t chunk = rd.u32();
    std::shared_ptr<const StateSnapshot> snap;
    uint64_t corrupt_after = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& s : {current_, previous_})
        if (s && s->digest == want) snap = s;
      corrupt_after = corrupt_after_;
    }
    const auto deadline = after(kDonorIdle);
    if (!snap || chunk == 0 || chunk > kMaxChunk || offset > snap->bytes.size() ||
        length > snap->bytes.size() - offset || length == 0) {
      std::string why = !snap ? "no longer holds that state" : "bad range";
      std::string p;
      put_str(p, why);
      c.send(kMsgStateRefuse, p, deadline);
      return;
    }
    for (uint64_t at = offset; at < offset + length; at += chunk) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk, offset + length - at));
      std::string_view data(snap->bytes.data() + at, n);
      std::string head;
      put_u64(head, at);
      put_str(head, chunk_digest(data));
      uint64_t served;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (die_after_ > 0 && served_ >= die_after_) return;  // (test hook) dead: the stream drops
        served = served_ += n;
      }
      if (corrupt_after > 0 && served > corrupt_after) {
        std::string bad(data);
        bad[0] = static_cast<char>(bad[0] ^ 0x5a);
        c.send(kMsgStateChunk, head, bad, after(kDonorIdle));
      } else {
        c.send(kMsgStateChunk, head, data, after(kDonorIdle));
      }
    }
    f = c.receive(after(kDonorIdle), 1024);
  }
}

// ---------------------------------------------------------------------------------------------
// Newcomer

namespace {
// Donors that vouch for a state: distinct identities at distinct addresses (k records of one
// identity, or k identities behind one address, are one voice).
size_t distinct_voices(const std::vector<DonorInfo>& v) {
  std::set<std::string> ids, addresses;
  for (const auto& d : v) ids.insert(d.peer_id), addresses.insert(d.address);
  return std::min(ids.size(), addresses.size());
}
}  // namespace

std::vector<DonorInfo> choose_donors(std::vector<DonorInfo> all, const DownloadOptions& o) {
  std::map<std::tuple<int64_t, Digest, uint64_t>, std::vector<DonorInfo>> by_state;
  for (auto& d : all)
    if (d.epoch >= o.min_epoch && d.epoch <= o.max_epoch && d.size > 0 && d.size <= o.max_bytes)
      by_state[{d.epoch, d.digest, d.size}].push_back(std::move(d));
  std::vector<DonorInfo>* best = nullptr;
  int64_t best_epoch = -1;
  size_t best_voices = 0;
  for (auto& [k, v] : by_state) {
    const size_t voices = distinct_voices(v);
    if (!best || voices > best_voices || (voices == best_voices && std::get<0>(k) > best_epoch))
      best = &v, best_epoch = std::get<0>(k), best_voices = voices;
  }
  if (!best) return {};
  std::vector<DonorInfo> out = std::move(*best);
  std::mt19937_64 rng(o.seed ? o.seed : std::random_device{}());
  std::shuffle(out.begin(), out.end(), rng);
  return out;
}

namespace {

struct Download {
  const DownloadOptions& o;
  const DonorInfo& ref;
  Deadline deadline;
  std::string bytes;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<uint64_t> pieces;  // offsets not yet delivered
  size_t left = 0;              // pieces not yet delivered
  size_t alive = 0;             // streams still working
  std::vector<std::string> used, failed;

  Download(const DownloadOptions& opts, const DonorInfo& r) : o(opts), ref(r) {}

  // Takes the next piece; false when none is left or all are done.
  bool take(uint64_t& offset) {
    std::unique_lock<std::mutex> lock(mu);
    // Wait while pieces are out with other streams: one of them may fail and hand its back.
    cv.wait_until(lock, deadline, [&] { return !pieces.empty() || left == 0; });
    if (pieces.empty()) return false;
    offset = pieces.front();
    pieces.pop_front();
    return true;
  }

  void run(const DonorInfo& d) {
    uint64_t offset = 0;
    bool holding = false, delivered = false;
    std::string why;
    try {
      auto c = Connection::connect(d.address, std::min(deadline, after(o.request_timeout)));
      while (take(offset)) {
        holding = true;
        const uint64_t len = std::min<uint64_t>(o.piece_bytes, ref.size - offset);
        std::string req;
        put_str(req, digest_str(ref.digest));
        put_u64(req, offset);
        put_u64(req, len);
        put_u32(req, static_cast<uint32_t>(o.chunk_bytes));
        c->send(kMsgStateRequest, req, std::min(deadline, after(o.next_chunk_timeout)));
        for (uint64_t at = offset; at < offset + len;) {
          Frame f = c->receive(std::min(deadline, after(o.next_chunk_timeout)), o.chunk_bytes + 64);
          Reader rd(f.payload);
          if (f.type == kMsgStateRefuse) throw NetError(NetError::Kind::kProtocol, "refused: " + rd.str(kMaxReason));
          if (f.type != kMsgStateChunk) throw NetError(NetError::Kind::kProtocol, "unexpected frame");
          const uint64_t got_at = rd.u64();
          const std::string sum = rd.str(kChunkSum);
          const std::string_view data = rd.rest();
          const uint64_t want = std::min<uint64_t>(o.chunk_bytes, offset + len - at);
          if (got_at != at || data.size() != want)
            throw NetError(NetError::Kind::kProtocol, "chunk out of order or of the wrong size");
          if (chunk_digest(data) != sum) throw NetError(NetError::Kind::kProtocol, "chunk checksum mismatch");
          std::memcpy(bytes.data() + at, data.data(), data.size());
          at += data.size();
        }
        std::lock_guard<std::mutex> lock(mu);
        holding = false, delivered = true;
        --left;
        cv.notify_all();
      }
    } catch (const NetError& e) {
      why = e.what();
    } catch (const std::exception& e) {
      why = e.what();
    }
    std::lock_guard<std::mutex> lock(mu);
    if (holding) pieces.push_front(offset);  // another stream takes it
    if (delivered) used.push_back(d.peer_id);
    if (!why.empty()) failed.push_back(short_id(d.peer_id) + " (" + d.address + "): " + why);
    --alive;
    cv.notify_all();
  }
};

}  // namespace

std::optional<StateSnapshot> download_state(const std::vector<DonorInfo>& donors, const DownloadOptions& o,
                                            DownloadReport* report, const std::vector<DonorInfo>& behind) {
  DownloadReport local;
  DownloadReport& rep = report ? *report : local;
  rep = DownloadReport{};
  const auto t0 = Clock::now();
  if (donors.empty()) {
    rep.why_none = "no state donor announced itself";
    return std::nullopt;
  }
  const DonorInfo ref = donors.front();
  PT_CHECK(o.piece_bytes > 0 && o.chunk_bytes > 0 && o.chunk_bytes <= kMaxChunk, "download_state: bad piece/chunk");
  if (ref.size > o.max_bytes) {
    rep.why_none = "announced state of " + std::to_string(ref.size) + " bytes exceeds the limit";
    return std::nullopt;
  }
  auto same = [&ref](const DonorInfo& d) { return d.epoch == ref.epoch && d.size == ref.size && d.digest == ref.digest; };
  Download dl(o, ref);
  dl.deadline = Clock::now() + o.timeout;
  dl.bytes.resize(ref.size);
  for (uint64_t at = 0; at < ref.size; at += o.piece_bytes) dl.pieces.push_back(at);
  dl.left = dl.pieces.size();
  // Donors of the same state: those given, then those recruited below (a deque: the streams
  // hold references to its elements while it grows). Up to max_donors streams run at once; a
  // donor in the pool beyond them stands by and starts a stream when one ends.
  std::deque<DonorInfo> pool(donors.begin(), donors.end());
  size_t next = 0;
  std::vector<std::thread> streams;
  const size_t max_streams = std::max<size_t>(1, o.max_donors);
  auto start_next = [&] {  // under dl.mu
    while (next < pool.size() && !same(pool[next])) ++next;
    if (next >= pool.size()) return false;
    ++dl.alive;
    const DonorInfo& d = pool[next++];
    streams.emplace_back([&dl, &d] { dl.run(d); });
    return true;
  };
  // Donors that were a step behind when asked (a newcomer arriving while the swarm steps finds
  // some donors mid-step) are asked again for this state, each every 200 ms while the download
  // lasts, at most next_chunk_timeout: one that reaches it joins the pool, so the download has
  // several donors and outlives the death of the one it began with.
  bool recruiting = !behind.empty(), stop = false;
  std::thread recruiter;
  if (recruiting) {
    recruiter = std::thread([&] {
      std::vector<DonorInfo> asking(behind);
      const auto until = std::min(dl.deadline, Clock::now() + o.next_chunk_timeout);
      while (!asking.empty()) {
        for (size_t i = 0; i < asking.size();) {
          {
            std::lock_guard<std::mutex> lock(dl.mu);
            if (stop || dl.left == 0) asking.clear();
          }
          if (asking.empty() || Clock::now() >= until) break;
          auto m = fetch_manifest(asking[i].address, ref.epoch, std::min(until, after(std::chrono::milliseconds(1'000))));
          if (!m) {
            ++i;  // not there yet (refused: still behind), or slow: asked again next pass
            continue;
          }
          m->peer_id = asking[i].peer_id;
          if (same(*m)) {
            std::lock_guard<std::mutex> lock(dl.mu);
            pool.push_back(std::move(*m));
            dl.cv.notify_all();
          }
          asking.erase(asking.begin() + static_cast<std::ptrdiff_t>(i));  // recruited, or at another state
        }
        if (Clock::now() >= until) break;
        std::unique_lock<std::mutex> lock(dl.mu);
        dl.cv.wait_for(lock, std::chrono::milliseconds(200), [&] { return stop || dl.left == 0; });
        if (stop || dl.left == 0) break;
      }
      std::lock_guard<std::mutex> lock(dl.mu);
      recruiting = false;
      dl.cv.notify_all();
    });
  }
  {
    std::unique_lock<std::mutex> lock(dl.mu);
    while (dl.alive < max_streams && start_next()) {
    }
    for (;;) {
      dl.cv.wait_until(lock, dl.deadline, [&] {
        return dl.left == 0 || (dl.alive < max_streams && next < pool.size()) || (dl.alive == 0 && !recruiting);
      });
      if (dl.left == 0 || Clock::now() >= dl.deadline) break;
      if (dl.alive < max_streams && next < pool.size()) {
        start_next();
        continue;
      }
      if (dl.alive == 0 && !recruiting) break;
    }
    stop = true;
    // Streams still working end by their own deadlines (every wait in run() is bounded by it);
    // wake the ones waiting for a piece.
    dl.cv.notify_all();
  }
  if (recruiter.joinable()) recruiter.join();  // at most one manifest request (1 s) away
  for (auto& t : streams) t.join();
  rep.donors_used = dl.used;
  rep.donors_failed = dl.failed;
  rep.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (dl.left != 0) {
    rep.why_none = std::to_string(dl.left) + " of " + std::to_string((ref.size + o.piece_bytes - 1) / o.piece_bytes) +
                   " pieces missing: " +
                   (Clock::now() >= dl.deadline ? "the download's deadline passed" : "every donor failed");
    return std::nullopt;
  }
  StateSnapshot s;
  s.epoch = ref.epoch;
  s.bytes = std::move(dl.bytes);
  s.digest = digest32(s.bytes);
  if (s.digest != ref.digest) {
    rep.why_none = "the assembled state does not match the digest its donors announced";
    return std::nullopt;
  }
  rep.bytes = s.bytes.size();
  return s;
}

std::optional<DonorInfo> fetch_manifest(const std::string& address, int64_t min_epoch, Deadline deadline,
                                        std::string* why) {
  try {
    auto c = Connection::connect(address, deadline);
    std::string req;
    put_u64(req, static_cast<uint64_t>(min_epoch));
    c->send(kMsgStateManifest, req, deadline);
    const Frame f = c->receive(deadline, 1024);
    if (f.type == kMsgStateRefuse) {
      Reader rd(f.payload);
      if (why) *why = "refused: " + rd.str(kMaxReason);
      return std::nullopt;
    }
    auto m = f.type == kMsgStateManifest ? decode_manifest(f.payload) : std::nullopt;
    if (!m && why) *why = "malformed manifest";
    if (m) m->address = address;
    return m;
  } catch (const NetError& e) {
    if (why) *why = e.what();
    return std::nullopt;
  }
}

std::optional<StateSnapshot> load_state_from_peers(DhtNode& dht, const std::string& key, const DownloadOptions& o,
                                                   DownloadReport* report) {
  DownloadReport local;
  DownloadReport& rep = report ? *report : local;
  const auto deadline = Clock::now() + o.timeout;
  std::vector<DonorInfo> announced;
  for (const auto& r : dht.fetch(key, std::min<std::chrono::milliseconds>(o.timeout, std::chrono::milliseconds(3'000)))) {
    if (r.kind != "donor" || r.owner == dht.identity().public_key()) continue;
    if (auto d = decode_donor(r.payload)) {  // its epoch may be stale: the manifest says
      d->peer_id = to_hex(r.owner);
      announced.push_back(std::move(*d));
    }
  }
  // Donors announcing an epoch beyond the vouched one could serve nothing we load (their
  // manifest is at least that new): they are not asked, so that records forged far ahead cannot
  // fill the manifest slots below and crowd out the honest donors.
  int64_t newer = -1;  // the oldest epoch past max_epoch a donor announced or answered with
  size_t ahead = 0;
  auto note_ahead = [&](int64_t epoch) {
    if (epoch <= o.max_epoch) return false;
    newer = newer < 0 ? epoch : std::min(newer, epoch);
    ++ahead;
    return true;
  };
  announced.erase(std::remove_if(announced.begin(), announced.end(), [&](const DonorInfo& d) { return note_ahead(d.epoch); }),
                  announced.end());
  // Newest first; among equals a random order (newcomers spread over the donors).
  std::mt19937_64 rng(o.seed ? o.seed : std::random_device{}());
  std::shuffle(announced.begin(), announced.end(), rng);
  std::stable_sort(announced.begin(), announced.end(), [](const auto& a, const auto& b) { return a.epoch > b.epoch; });
  if (announced.size() > 2 * std::max<size_t>(1, o.max_donors)) announced.resize(2 * std::max<size_t>(1, o.max_donors));
  // Manifests in parallel, each within request_timeout (a donor snapshots on demand).
  std::vector<std::optional<DonorInfo>> manifests(announced.size());
  std::vector<std::string> why(announced.size());
  {
    std::vector<std::thread> asks;
    for (size_t i = 0; i < announced.size(); ++i)
      asks.emplace_back([&, i] {
        manifests[i] = fetch_manifest(announced[i].address, o.min_epoch,
                                      std::min(deadline, after(o.request_timeout + o.next_chunk_timeout)), &why[i]);
      });
    for (auto& t : asks) t.join();
  }
  std::vector<DonorInfo> candidates;
  std::vector<std::string> failed;
  for (size_t i = 0; i < announced.size(); ++i) {
    if (manifests[i]) {
      manifests[i]->peer_id = announced[i].peer_id;
      candidates.push_back(std::move(*manifests[i]));
    } else {
      failed.push_back(short_id(announced[i].peer_id) + " (" + announced[i].address + "): manifest: " + why[i]);
    }
  }
  DownloadOptions rest = o;
  rest.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  if (rest.timeout.count() <= 0) rest.timeout = std::chrono::milliseconds(1);
  auto chosen = choose_donors(candidates, rest);
  // Donors a step or more behind the chosen state (mid-step when asked) are asked again.
  std::vector<DonorInfo> behind;
  if (!chosen.empty())
    for (const auto& d : candidates)
      if (d.epoch < chosen.front().epoch) behind.push_back(d);
  auto got = download_state(chosen, rest, &rep, behind);
  rep.donors_failed.insert(rep.donors_failed.begin(), failed.begin(), failed.end());
  if (!got && announced.empty()) rep.why_none = "no state donor at epoch " + std::to_string(o.min_epoch) + " or later announced itself";
  if (!got && chosen.empty()) {
    for (const auto& d : candidates) note_ahead(d.epoch);
    if (newer >= 0) {
      rep.newer_than_vouched = newer;
      rep.why_none = std::to_string(ahead) + " donor(s) at epoch " + std::to_string(newer) +
                     " or later: beyond the swarm's vouched epoch " + std::to_string(o.max_epoch);
    }
  }
  return got;
}

}  // namespace polytrain::hivemind
