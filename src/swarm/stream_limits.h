// The stream quotas of a swarm peer's Server (wire.h: StreamLimits), per service of the swarm:
// all-reduce, matchmaking, state download, dial-back. wire.h knows no service; whoever builds
// a peer's Server passes these.
#pragma once

#include <chrono>
#include <cstddef>

#include "polytrain/swarm/wire.h"

namespace polytrain::hivemind {

/// The run's timeouts that bound its streams.
struct SwarmStreamTimes {
  std::chrono::milliseconds averaging{60'000};    ///< hivemind.averaging_timeout (a round, matchmaking included)
  std::chrono::milliseconds load_state{600'000};  ///< hivemind.load_state_timeout (a whole download)
  std::chrono::milliseconds next_chunk{10'000};   ///< hivemind.next_chunk_timeout (first contact; the margin)
};

/// Each service's quota and lifetime: an averaging or join stream lives at most a round (plus
/// a chunk's margin), a state stream a download, a dial-back a few seconds; one address holds
/// at most `per_ip` streams. The quotas leave the averaging services room whatever the others
/// hold: a newcomer holding state or dial-back streams, or silent connections, cannot starve
/// the swarm's rounds.
StreamLimits swarm_stream_limits(const SwarmStreamTimes& times = {}, size_t per_ip = 64);

}  // namespace polytrain::hivemind
