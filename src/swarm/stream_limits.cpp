// swarm_stream_limits: the numbers, and why they are these.
#include "polytrain/swarm/stream_limits.h"

#include "polytrain/swarm/butterfly.h"
#include "polytrain/swarm/matchmaking.h"
#include "polytrain/swarm/state.h"

namespace polytrain::hivemind {

StreamLimits swarm_stream_limits(const SwarmStreamTimes& times, size_t per_ip) {
  using std::chrono::milliseconds;
  StreamLimits l;
  // A member of a group of n receives n - 1 all-reduce streams, and a leader n - 1 joins, at
  // once: 256 each covers target_group_size's default. max_streams is at least the sum of all
  // quotas and the pending streams, so that no service, however full, takes another's slots.
  l.max_streams = 768;
  l.per_ip = per_ip;
  l.max_pending = 64;
  l.first_frame = times.next_chunk;
  const milliseconds round = times.averaging + times.next_chunk;
  l.services[kMsgAllReduceHello] = {256, round};
  l.services[kMsgJoin] = {256, round};
  // A newcomer downloads from up to 4 donors at once, one stream each, for at most its
  // load_state_timeout; 16 newcomers at once is a crowd.
  const milliseconds download = times.load_state + times.next_chunk;
  l.services[kMsgStateRequest] = {64, download};
  l.services[kMsgStateManifest] = {64, download};
  l.services[kMsgDialBack] = {16, milliseconds(5'000)};  // one connect of 1 s and a reply
  l.per_service = {16, round};                            // nobody serves other types
  return l;
}

}  // namespace polytrain::hivemind
