// Connection::Impl, shared by wire.cpp (the frames) and server.cpp (accepting streams): a
// stream's socket on its own io_context. Internal to the swarm sources (includes <asio.hpp>).
#pragma once

#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <asio.hpp>
#include <atomic>
#include <cstring>
#include <functional>
#include <string>
#include <utility>

#include "polytrain/swarm/wire.h"

namespace polytrain::hivemind {

// The blocking-with-deadline pattern of asio's own timeout examples: start an asynchronous
// operation, run this stream's private io_context until the deadline, and close the socket
// when the operation has not completed by then.
struct Connection::Impl {
  asio::io_context io;
  asio::ip::tcp::socket sock{io};
  std::atomic<int> fd{-1};
  std::atomic<bool> aborted{false};
  std::string remote;

  template <typename Start>
  size_t run(Start&& start, Deadline deadline, const char* what) {
    if (aborted) throw NetError(NetError::Kind::kClosed, std::string(what) + " " + remote + ": stream aborted");
    std::error_code ec = asio::error::would_block;
    size_t n = 0;
    start(ec, n);
    io.restart();
    io.run_until(deadline);
    if (ec == asio::error::would_block) {
      std::error_code ignore;
      sock.close(ignore);
      io.restart();
      io.run();  // lets the cancelled operation finish
      throw NetError(NetError::Kind::kTimeout, std::string(what) + " " + remote + ": timed out");
    }
    if (ec) throw NetError(NetError::Kind::kClosed, std::string(what) + " " + remote + ": " + ec.message());
    return n;
  }

  // asio's transfer_all moves at most 64 KiB per system call; a frame body is asked for whole
  // (one call per what the socket holds), and the socket wakes this reader only once it holds
  // min(what is left, kLowWater) bytes (SO_RCVLOWAT): a 1 MiB chunk costs a few wake-ups and
  // reads instead of one per 64 KiB segment the loopback delivers.
  static constexpr size_t kLowWater = size_t{256} << 10;
  int lowat = 1;
  void set_lowat(size_t want) {
    const int v = static_cast<int>(std::max<size_t>(1, std::min(want, kLowWater)));
    if (v == lowat) return;
    ::setsockopt(sock.native_handle(), SOL_SOCKET, SO_RCVLOWAT, &v, sizeof v);
    lowat = v;
  }
  template <typename Buffers>
  void read_body(const Buffers& bufs, size_t total, Deadline deadline) {
    run(
        [&](std::error_code& result, size_t& n) {
          asio::async_read(
              sock, bufs,
              [this, total](const std::error_code& e, size_t done) -> size_t {
                if (e || done >= total) return 0;
                set_lowat(total - done);
                return total - done;
              },
              [&](const std::error_code& e, size_t k) { result = e, n = k; });
        },
        deadline, "receive from");
    set_lowat(1);
  }

  /// Reads a frame's 5-byte header; returns the body length it announces.
  uint32_t read_header(std::array<uint8_t, 5>& hdr, Deadline deadline) {
    run(
        [&](std::error_code& result, size_t& n) {
          asio::async_read(sock, asio::buffer(hdr), [&](const std::error_code& e, size_t k) { result = e, n = k; });
        },
        deadline, "receive from");
    uint32_t len = 0;
    std::memcpy(&len, hdr.data(), 4);
    if (on_first_type) std::exchange(on_first_type, nullptr)(hdr[4]);
    return len;
  }

  // Set by a Server: told the type of the stream's first frame (its service); may refuse the
  // stream by throwing NetError.
  std::function<void(uint8_t)> on_first_type;

  void adopt() {
    fd = sock.native_handle();
    std::error_code ec;
    sock.set_option(asio::ip::tcp::no_delay(true), ec);
    auto ep = sock.remote_endpoint(ec);
    if (!ec) remote = ep.address().to_string() + ":" + std::to_string(ep.port());
  }
};

}  // namespace polytrain::hivemind
