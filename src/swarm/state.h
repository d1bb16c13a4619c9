// Joining late: state donors and load_state_from_peers (hivemind's
// DecentralizedAverager.load_state_from_peers), no torch.
//
// A donor announces itself under `{run_id}_state` (a signed `donor` record: its address and
// epoch). Its state is one immutable byte snapshot (parameters, optimizer state, epoch: the
// backend serialises them) with its BLAKE2b-256 digest, made on demand: the first newcomer
// that asks for the donor's manifest (epoch, size, digest) makes the donor take a snapshot
// through its provider (the backend, under the lock its optimizer step holds), so a swarm that
// nobody joins pays nothing. The snapshot is then served by byte ranges over direct TCP; the
// previous one stays servable, so a download that spans the donor's next step completes.
//
// A newcomer reads the donors, asks several for their manifests, keeps those at the newest
// epoch that agree on the most common digest, and downloads from up to max_donors of them at
// once: the snapshot is cut into
// pieces; each donor's stream takes the next piece left, and every chunk carries its own
// digest (a corrupted chunk fails that donor). A donor that fails (closed stream, a chunk
// later than next_chunk_timeout, a bad chunk) is dropped and its piece goes back to the
// others. The whole download has one deadline, and the assembled snapshot is checked against
// the announced digest before it is returned. Donors are taken in a random order, so
// newcomers spread over the swarm instead of all loading from one peer.
#pragma once

#include <array>
#include <chrono>
#include <functional>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "polytrain/swarm/butterfly.h"
#include "polytrain/swarm/wire.h"

namespace polytrain::hivemind {

class DhtNode;

/// Frame types of state download.
enum : uint8_t { kMsgStateRequest = 30, kMsgStateChunk = 31, kMsgStateRefuse = 32, kMsgStateManifest = 33 };

using Digest = std::array<uint8_t, 32>;
Digest digest32(std::string_view data);  ///< BLAKE2b-256

/// A donor: its announcement (the `donor` record: address and epoch) and its manifest (size
/// and digest of the snapshot it serves; size 0 until asked).
struct DonorInfo {
  std::string peer_id, address;
  int64_t epoch = 0;
  uint64_t size = 0;
  Digest digest{};
};
std::string encode_donor(const DonorInfo& d);  ///< address and epoch
std::optional<DonorInfo> decode_donor(const std::string& payload);
std::string encode_manifest(const DonorInfo& d);  ///< epoch, size and digest
std::optional<DonorInfo> decode_manifest(const std::string& payload);

struct StateSnapshot {
  int64_t epoch = 0;
  std::string bytes;
  Digest digest{};
};

/// What a donor serves, in one byte string: the swarm's epoch, the model (a checkpoint's
/// state.pt: every parameter and buffer by name), the optimizer state (a checkpoint's
/// shard_0.pt) and the peer's configuration (JSON). Byte-compatible with a checkpoint's files,
/// so a monitor with no model writes a loadable checkpoint from it. Model and optimizer are
/// safetensors-encoded archives (checkpoint/archive_codec.h): a newcomer validates and rebuilds
/// them; libtorch's TorchScript reader never sees a donor's bytes.
struct PeerState {
  int64_t epoch = 0;
  std::string model, optimizer, config;
};
std::string pack_peer_state(const PeerState& s);
/// nullopt when `bytes` is not a packed PeerState (wrong magic, truncated, trailing bytes).
std::optional<PeerState> unpack_peer_state(std::string_view bytes);

/// Serves this peer's state to newcomers and announces it in the DHT.
class StateDonor {
 public:
  /// Makes a snapshot of the peer's state now (called from a serving thread).
  using Provider = std::function<StateSnapshot()>;
  /// Registers its service on `router`; announces under `key` (via `dht`, may be null: no
  /// announcement, tests) as reachable at `address`.
  StateDonor(DhtNode* dht, Router& router, std::string key, std::string address,
             std::chrono::milliseconds ttl = std::chrono::milliseconds(60'000));
  ~StateDonor();
  /// Snapshots on demand: a manifest request for a newer epoch than the snapshot held calls it;
  /// once the donor has announced an epoch, a request beyond it is refused without a snapshot.
  void set_provider(Provider p);
  /// Replaces the snapshot served (the previous one stays servable).
  void publish(int64_t epoch, std::string bytes);
  /// Tells the donor its peer is at `epoch` (call after every step): manifests describe a
  /// snapshot at least that new. The DHT record is stored on the first call and again every
  /// half of its lifetime.
  void announce(int64_t epoch);
  /// Its current snapshot's manifest (size 0 before any).
  DonorInfo info() const;
  /// Snapshots taken on demand so far.
  uint64_t snapshots_made() const;
  uint64_t bytes_served() const;
  /// Streams being served now (tests: they end when their requester leaves).
  size_t serving() const;
  /// Test hook: chunks served after this many bytes are corrupted (0 = never).
  void corrupt_after(uint64_t bytes);
  /// Test hook: once this many bytes are served the donor drops every range stream, as a
  /// crashed peer would, and serves no more chunks (0 = never).
  void die_after(uint64_t bytes);

 private:
  void serve(Connection& c, const Frame& f);
  std::shared_ptr<const StateSnapshot> snapshot_for(int64_t min_epoch);
  void install(std::shared_ptr<StateSnapshot> s);
  DhtNode* dht_;
  std::string key_, address_, peer_id_;
  std::chrono::milliseconds ttl_;
  mutable std::mutex mu_;
  std::mutex provide_mu_;  ///< one snapshot made at a time
  Provider provider_;
  std::shared_ptr<const StateSnapshot> current_, previous_;
  uint64_t served_ = 0, corrupt_after_ = 0, die_after_ = 0, made_ = 0;
  size_t serving_ = 0;
  int64_t announced_epoch_ = -1;
  Clock::time_point announced_at_{};
  /// The DHT store of the announcement runs here, off the caller's path (step(): a store to a
  /// stalled node waits its whole timeout); one at a time, joined by the destructor.
  std::thread announcer_;
  bool announcing_ = false;  ///< under mu_
};

struct DownloadOptions {
  std::chrono::milliseconds timeout{600'000};             ///< the whole download, one deadline
  std::chrono::milliseconds request_timeout{3'000};       ///< connecting to a donor
  std::chrono::milliseconds next_chunk_timeout{10'000};   ///< each next chunk of a stream
  size_t max_donors = 4;                                  ///< streams at once
  size_t piece_bytes = size_t{4} << 20;                   ///< unit of work handed to a stream
  size_t chunk_bytes = size_t{1} << 20;                   ///< frames within a piece
  uint64_t max_bytes = uint64_t{16} << 30;                ///< refuse larger announced states
  int64_t min_epoch = 0;                                  ///< ignore donors behind this
  /// Ignore donors ahead of this: the epoch the swarm vouches for (progress.h), so that a state
  /// claimed at an epoch no one else reached is never loaded.
  int64_t max_epoch = INT64_MAX;
  uint64_t seed = 0;                                      ///< donor order (0: random)
};

struct DownloadReport {
  std::vector<std::string> donors_used;    ///< peer ids that delivered at least one piece
  std::vector<std::string> donors_failed;  ///< with the reason, "id: why"
  uint64_t bytes = 0;
  double seconds = 0.0;
  std::string why_none;  ///< when nothing was returned
  /// When nothing was returned because every donor's state is newer than o.max_epoch (the
  /// swarm moved on after the caller read its vouched epoch): the oldest such epoch, else -1.
  int64_t newer_than_vouched = -1;
};

/// Chooses the donors to load from: among the states (epoch, digest, size) at an epoch in
/// [min_epoch, max_epoch] and size <= max_bytes, the one the most donors announce (the newest on
/// a tie), so that one donor's word does not beat an agreeing majority. Donors count as distinct
/// identities at distinct addresses: many records of one peer id, or many ids behind one
/// address, are one donor. In a random order (seeded by o.seed when nonzero).
std::vector<DonorInfo> choose_donors(std::vector<DonorInfo> all, const DownloadOptions& o);

/// Asks the donor at `address` for its manifest at `min_epoch` or later (it snapshots on
/// demand); nullopt when it refuses, fails or misses `deadline`.
std::optional<DonorInfo> fetch_manifest(const std::string& address, int64_t min_epoch, Deadline deadline,
                                        std::string* why = nullptr);

/// Downloads the snapshot all `donors` announce (same epoch, size and digest) before o.timeout;
/// nullopt (and report->why_none) when no donor could finish it or the result does not match.
/// Donors `behind` it (an older epoch: mid-step when asked) are asked again every 200 ms, for
/// at most next_chunk_timeout while the download lasts; each that reaches it joins the download.
std::optional<StateSnapshot> download_state(const std::vector<DonorInfo>& donors, const DownloadOptions& o,
                                            DownloadReport* report = nullptr,
                                            const std::vector<DonorInfo>& behind = {});

/// Reads the donors announced under `key`, asks up to 2 x max_donors of them (newest first) for
/// their manifests, and downloads from the ones chosen.
std::optional<StateSnapshot> load_state_from_peers(DhtNode& dht, const std::string& key, const DownloadOptions& o,
                                                   DownloadReport* report = nullptr);

}  // namespace polytrain::hivemind
