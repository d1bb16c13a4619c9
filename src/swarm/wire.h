// Direct TCP between peers (standalone asio): length-prefixed frames, and no operation without
// a deadline. A frame is [u32 little-endian body length][u8 type][payload]; the body length
// counts the type byte and is bounded by the reader. No torch.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>

#include "polytrain/common/error.h"

namespace polytrain::hivemind {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

inline Deadline after(std::chrono::milliseconds d) { return Clock::now() + d; }

/// A network operation that did not complete: timed out, closed by the other side, refused,
/// or a frame that breaks the protocol.
class NetError : public std::runtime_error {
 public:
  enum class Kind { kTimeout, kClosed, kProtocol };
  NetError(Kind k, const std::string& what) : std::runtime_error(what), kind(k) {}
  Kind kind;
};

struct Frame {
  uint8_t type = 0;
  std::string payload;
};

/// One TCP stream. Not thread-safe except abort().
class Connection {
 public:
  ~Connection();
  /// Connects to HOST:PORT before `deadline` (NetError otherwise).
  static std::unique_ptr<Connection> connect(const std::string& host_port, Deadline deadline);

  /// Sends one frame whose payload is `head` followed by `body` (no copy of either).
  void send(uint8_t type, std::string_view head, std::string_view body, Deadline deadline);
  void send(uint8_t type, std::string_view payload, Deadline deadline) { send(type, payload, {}, deadline); }
  /// Receives one frame; NetError(kProtocol) when its length exceeds max_bytes.
  Frame receive(Deadline deadline, size_t max_bytes);
  /// Receives one frame straight into caller memory: when it is a `type` frame whose payload is
  /// exactly head_len + body_len bytes, the first head_len bytes land in `head` and the rest in
  /// `body` (no allocation, no copy) and it returns true. Any other frame (a refusal, say) of at
  /// most max_other bytes is returned whole in `other` and it returns false; a longer one is
  /// NetError(kProtocol).
  bool receive_into(Deadline deadline, uint8_t type, void* head, size_t head_len, void* body, size_t body_len,
                    Frame& other, size_t max_other);
  /// Ends the stream from any thread: a pending or later operation fails at once.
  void abort();
  /// "HOST:PORT" of the other side.
  std::string remote() const;
  uint64_t bytes_sent() const { return sent_; }
  uint64_t bytes_received() const { return received_; }

  struct Impl;

 private:
  explicit Connection(std::unique_ptr<Impl> impl);
  friend class Server;
  std::unique_ptr<Impl> impl_;
  uint64_t sent_ = 0, received_ = 0;
};

/// The error of a listening socket that could not bind `listen` (named by the key `what`) for
/// errno `err`: a port in use names the flag that changes it; `port_role` says which socket
/// ("TCP port 5000, for averaging streams").
InputError listen_error(const std::string& what, const std::string& listen, int err, const std::string& port_role);

/// How many streams a Server holds at once, and for how long. A stream's service is the type of
/// its first frame (learnt when its handler reads it); until then the stream is pending. The
/// quotas keep one address, one service or a crowd of silent connections from taking every
/// slot: a newcomer that opens hundreds of streams, or holds them, cannot starve the others.
struct StreamLimits {
  struct Service {
    size_t max_streams = 128;                    ///< streams of this service at once
    std::chrono::milliseconds lifetime{900'000};  ///< the most one stream lives, from its accept
  };
  size_t max_streams = 256;  ///< all streams at once (one thread each)
  size_t per_ip = 64;        ///< streams at once from one IP address (loopback tests raise it)
  size_t max_pending = 64;   ///< streams before their first frame; a new one closes the oldest
  std::chrono::milliseconds first_frame{10'000};  ///< a pending stream is closed after this
  Service per_service;                            ///< any service not in `services`
  std::map<uint8_t, Service> services;            ///< by first frame type
  const Service& service(uint8_t type) const;
};

/// What a Server refused or closed, by reason (each also logged, at most a line per 5 s).
struct StreamCounts {
  uint64_t refused_ip = 0;       ///< the address already held per_ip streams
  uint64_t refused_full = 0;     ///< max_streams were held and none was pending
  uint64_t evicted_pending = 0;  ///< a pending stream closed to make room for a new one
  uint64_t refused_service = 0;  ///< its service already held its max_streams
  uint64_t expired = 0;          ///< closed at first_frame or its lifetime
};

/// A TCP listener: each accepted stream is handed to `handler` on its own thread, within
/// `limits`.
class Server {
 public:
  using Handler = std::function<void(Connection&)>;
  /// Binds HOST:PORT (port 0: any). InputError naming `what` when it cannot.
  Server(const std::string& listen, Handler handler, const std::string& what = "hivemind.listen",
         StreamLimits limits = {});
  ~Server();  ///< stop()
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;
  /// HOST:PORT as bound (0.0.0.0 reported as 127.0.0.1).
  std::string address() const;
  uint16_t port() const;
  /// Stops accepting, aborts the live streams and joins their threads.
  void stop();
  /// Streams being handled now.
  size_t live() const;
  StreamCounts counts() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// Little-endian scalar packing for frame payloads.
void put_u32(std::string& s, uint32_t v);
void put_u64(std::string& s, uint64_t v);
void put_f64(std::string& s, double v);
void put_str(std::string& s, std::string_view v);  ///< u32 length + bytes

/// Reads what put_* wrote; NetError(kProtocol) on a short or oversized field.
class Reader {
 public:
  explicit Reader(std::string_view s) : s_(s) {}
  uint32_t u32();
  uint64_t u64();
  double f64();
  std::string str(size_t max_bytes);
  std::string_view rest() const { return s_.substr(pos_); }
  bool done() const { return pos_ == s_.size(); }

 private:
  std::string_view take(size_t n);
  std::string_view s_;
  size_t pos_ = 0;
};

}  // namespace polytrain::hivemind
