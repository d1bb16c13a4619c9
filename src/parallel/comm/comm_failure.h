// The failure fault tolerance recovers from: a collective that could not finish because a peer
// is gone (a closed connection) or silent past trainer.comm_timeout. Everything else a
// communicator throws is an ordinary Error.
#pragma once

#include "polytrain/common/error.h"

namespace polytrain {

class CommFailure : public Error {
 public:
  using Error::Error;
};

}  // namespace polytrain
