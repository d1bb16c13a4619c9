// Fault-tolerant butterfly all-reduce over direct TCP (hivemind's AllReduceRunner), no torch.
//
// A group of peers averages one flat float32 vector. The vector is cut into parts, one per
// member that accepts connections, sized in proportion to the bandwidth it declared (client-
// mode members reduce nothing). Every member streams its slice of part j to member j in
// chunks; member j averages the part over the members that delivered all of it, weighted by
// the samples each accumulated, and streams the result back. An auxiliary member (hivemind's
// AveragingMode.AUX, a peer started with --assist_in_averaging) reduces its part like any
// other but sends no vector of its own and contributes nothing to any average (weight 0: its
// own values are never read), so client-mode members can average through it. Failures:
//  - a sender that fails (closed stream, a chunk later than next_chunk_timeout, a broken
//    frame) is excluded from that part: the average is exactly the others';
//  - a reducer that fails leaves its part local on every sender (delta 0), but for the
//    result chunks that reached it whole before the failure, and the report says which
//    fraction of the vector kept its local values;
//  - the round ends by allreduce_timeout whatever happens.
// Without compression the reducer sends the average itself, so every member ends with the
// same bits; with compression it sends average minus what it received (hivemind's deltas),
// so quantisation error does not accumulate in the weights. In a group from matchmaking each
// stream's hello is signed by its sender and checked by the reducer (group_auth.h).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "polytrain/swarm/compression.h"
#include "polytrain/swarm/robust.h"
#include "polytrain/swarm/wire.h"

namespace polytrain::hivemind {

class Identity;

/// Frame types of the averaging protocol.
enum : uint8_t { kMsgAllReduceHello = 10, kMsgChunk = 11, kMsgResult = 12, kMsgRefuse = 13 };

struct Member {
  std::string peer_id;
  std::string address;     ///< HOST:PORT it accepts streams on; empty for a client-mode peer
  double bandwidth = 1.0;  ///< relative share of the vector it reduces (> 0 unless a client)
  /// Reduces its part, sends nothing and is averaged into nothing (hivemind's AUX mode); it
  /// accepts streams (an address and a bandwidth > 0).
  bool auxiliary = false;
  /// Its signed request to join the leader (group_auth.h), carried in the leader's list so that
  /// every follower can check the entry; empty for the leader and in groups built by hand.
  std::string join;
};

/// The same on every member (the leader's order).
struct Group {
  std::string group_id;
  std::vector<Member> members;
  size_t self = 0;  ///< this peer's index in members
  /// This peer's key when the group came from matchmaking (members' peer ids are then their
  /// verified public keys): its hellos are signed with it, and a stream to its part is taken only
  /// with the signature of the member whose index it claims (group_auth.h). Null (groups built by
  /// hand): hellos are neither signed nor checked.
  std::shared_ptr<const Identity> identity;
};

struct AllReduceOptions {
  Compression compression = Compression::kNone;
  std::chrono::milliseconds allreduce_timeout{60'000};   ///< the whole round
  std::chrono::milliseconds next_chunk_timeout{10'000};  ///< first contact and each next chunk
  size_t chunk_elements = size_t{1} << 18;               ///< 1 MiB of float32 per chunk
  /// A sender's weight above this (or not finite) leaves it out of the reducer's average, as
  /// non-finite values do: one member cannot outweigh the group (the samples of a step are
  /// bounded by the swarm's target batch).
  double max_weight = std::numeric_limits<double>::infinity();
  /// A tighter bound per sender (peer id -> the most samples it can have behind this round: what
  /// its signed progress records claimed, progress.h's SignedWeights); empty: max_weight alone.
  /// A contribution whose weight is above it counts with this weight instead (clamped, not left
  /// out: the bound is read from records that may lag the sender's last micro-batch).
  std::function<double(const std::string&)> sender_max_weight;
  /// How the reducer combines its part's contributions (hivemind.aggregation): the weighted
  /// mean, or CenteredClip with this tau and at most this many iterations (robust.h).
  Aggregation aggregation = Aggregation::kMean;
  double centered_clip_tau = 1.0;
  int centered_clip_iterations = 5;
  /// Every member ends with the same bits under a lossy compression: a reducer sends its average
  /// compressed (instead of hivemind's difference to what each member sent, more precise but
  /// different per member) and keeps the decoded values for its own part. Local updates need it:
  /// every peer continues from the same outer parameters. The members of a round must agree.
  bool same_result = false;
};

/// A reducer's share of the vector is its bandwidth, capped at this many times the median
/// bandwidth of the group's reducers: a member declaring 1e300 reduces a bounded part.
constexpr double kMaxBandwidthRatio = 4.0;
/// A declared bandwidth counts at most this much wherever it is read (a join, a declaration, a
/// group list): a relative share, so no honest setting needs more (hivemind.bandwidth is
/// validated against it), and no sum or product of a group's bandwidths overflows.
constexpr double kMaxDeclaredBandwidth = 1e6;

struct AllReduceReport {
  double local_fraction = 0.0;  ///< of the vector left as it was (its reducer failed before answering it)
  std::vector<std::string> failed_reducers;   ///< peer ids
  std::vector<std::string> excluded_senders;  ///< from this peer's own part
  /// Senders left out of this peer's own part for non-finite values or a weight above
  /// max_weight (this peer's own id when its own part was).
  std::vector<std::string> rejected_senders;
  /// Contributions to this peer's own part that CenteredClip scaled by less than one half.
  std::vector<std::string> clipped_senders;
  /// Contributions to this peer's own part whose weight was cut to sender_max_weight.
  std::vector<std::string> clamped_senders;
  /// Streams refused because their hello was not signed by the member whose index it claimed.
  size_t unsigned_hellos = 0;
  /// Members banned earlier (Offences): left out of this peer's part, and not sent parts to.
  std::vector<std::string> banned_members;
  /// Members this round's offences banned for the rest of the run.
  std::vector<std::string> newly_banned;
  double part_weight = 0.0;                   ///< samples behind this peer's own part's average
  size_t part_elements = 0;                   ///< of this peer's own part (0: it reduced nothing)
  size_t part_senders = 0;                    ///< contributions averaged into this peer's own part
  uint64_t bytes_sent = 0, bytes_received = 0;  ///< every stream of the round, as sender and as reducer
  double seconds = 0.0;
  /// One line for the log when something failed (empty otherwise).
  std::string warning() const;
};

/// Elements of part j of an n-element vector (proportional to bandwidth, largest remainder).
std::vector<size_t> part_sizes(size_t n, const Group& g);

/// One peer's averaging endpoint: allreduce() runs rounds; handle() serves the streams other
/// members open to it (its Router sends kMsgAllReduceHello streams here).
class Averager {
 public:
  Averager();
  ~Averager();
  /// Averages data[0..n) with the group, weighted by `weight` (samples accumulated; >= 0). An
  /// auxiliary member (g.members[g.self].auxiliary) only reduces its own part of `data`, over
  /// the others' contributions, and ignores `weight`; the rest of `data` is not touched.
  AllReduceReport allreduce(const Group& g, float* data, size_t n, double weight, const AllReduceOptions& o);
  /// Serves one incoming stream whose first frame `hello` was kMsgAllReduceHello.
  void handle(Connection& c, const Frame& hello);
  /// Rounds registered now (tests: memory does not grow across rounds).
  size_t rounds() const;
  /// The offences seen in this peer's own parts over the run, and who is banned for them.
  Offences& offences() { return offences_; }
  const Offences& offences() const { return offences_; }

  struct Round;

 private:
  std::shared_ptr<Round> wait_for_round(const std::string& group_id, Deadline until);
  /// Registers the round of this peer's own part (`len` elements) before anyone can stream to it.
  std::shared_ptr<Round> register_round(const Group& g, size_t len, const AllReduceOptions& o, Clock::time_point t0,
                                        Deadline deadline);
  /// Waits until no stream reads the average from the caller's vector any more, then forgets the round.
  void release_round(const std::string& group_id, Round& round);
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::shared_ptr<Round>> rounds_;
  Offences offences_;
};

/// Dispatches each incoming stream on the type of its first frame.
class Router {
 public:
  using Service = std::function<void(Connection&, const Frame&)>;
  void on(uint8_t type, Service s);
  /// For Server: reads the first frame (within `first_frame`) and runs its service.
  Server::Handler handler(std::chrono::milliseconds first_frame = std::chrono::milliseconds(10'000));

 private:
  std::mutex mu_;
  std::map<uint8_t, Service> services_;
};

/// Reachability, the question hivemind's peers put to libp2p's AutoNAT, answered by a peer
/// already in the swarm: kMsgDialBack carries an address; the peer asked opens a stream to it
/// (only on the IP the request came from: nobody can make it dial third parties) within 1 s
/// and answers kMsgDialBackReply "1" or "0" ("-" for an address on another IP). A peer behind a NAT or a firewall learns at start
/// that nobody can stream to it, and takes part as a client instead of being excluded from
/// every round.
enum : uint8_t { kMsgDialBack = 40, kMsgDialBackReply = 41 };
void serve_dial_back(Router& router);
/// Asks the peer at `helper` whether it can open a stream to `address`: true or false, nothing
/// when the helper did not answer by `deadline` or would not dial it.
std::optional<bool> ask_dial_back(const std::string& helper, const std::string& address, Deadline deadline);

/// A peer that only averages (tests, benchmarks): its server (none in client mode), router and
/// averager.
struct AveragingPeer {
  Averager averager;
  Router router;
  std::unique_ptr<Server> server;
  explicit AveragingPeer(bool client = false, const std::string& listen = "127.0.0.1:0");
  std::string address() const { return server ? server->address() : ""; }
};

}  // namespace polytrain::hivemind
