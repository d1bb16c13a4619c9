#include "polytrain/swarm/wire.h"

#include <sys/socket.h>

#include <array>
#include <asio.hpp>
#include <cerrno>
#include <cstring>

#include "polytrain/common/error.h"
#include "polytrain/swarm/dht.h"

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
    return len;
  }

  void adopt() {
    fd = sock.native_handle();
    std::error_code ec;
    sock.set_option(asio::ip::tcp::no_delay(true), ec);
    auto ep = sock.remote_endpoint(ec);
    if (!ec) remote = ep.address().to_string() + ":" + std::to_string(ep.port());
  }
};

Connection::Connection(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Connection::~Connection() = default;

std::unique_ptr<Connection> Connection::connect(const std::string& host_port, Deadline deadline) {
  auto impl = std::make_unique<Impl>();
  impl->remote = host_port;
  std::pair<std::string, uint16_t> hp;
  try {
    hp = split_host_port(host_port, "peer address");
  } catch (const InputError& e) {
    throw NetError(NetError::Kind::kProtocol, e.what());
  }
  std::error_code ec;
  auto addr = asio::ip::make_address(hp.first, ec);
  std::vector<asio::ip::tcp::endpoint> eps;
  if (!ec) {
    eps.emplace_back(addr, hp.second);
  } else {
    asio::ip::tcp::resolver resolver(impl->io);
    auto results = resolver.resolve(hp.first, std::to_string(hp.second), ec);
    if (ec) throw NetError(NetError::Kind::kClosed, "connect " + host_port + ": " + ec.message());
    for (const auto& r : results) eps.push_back(r.endpoint());
  }
  impl->run(
      [&](std::error_code& result, size_t&) {
        asio::async_connect(impl->sock, eps,
                            [&result](const std::error_code& e, const asio::ip::tcp::endpoint&) { result = e; });
      },
      deadline, "connect");
  impl->adopt();
  return std::unique_ptr<Connection>(new Connection(std::move(impl)));
}

void Connection::send(uint8_t type, std::string_view head, std::string_view body, Deadline deadline) {
  const uint64_t len = 1 + head.size() + body.size();
  PT_CHECK(len <= UINT32_MAX, "frame of ", len, " bytes");
  std::array<uint8_t, 5> hdr{};
  const uint32_t l = static_cast<uint32_t>(len);
  std::memcpy(hdr.data(), &l, 4);  // little-endian hosts only (x86-64, aarch64)
  hdr[4] = type;
  const std::array<asio::const_buffer, 3> bufs = {asio::buffer(hdr), asio::buffer(head.data(), head.size()),
                                                  asio::buffer(body.data(), body.size())};
  const size_t total = hdr.size() + head.size() + body.size();
  impl_->run(
      [&](std::error_code& result, size_t& n) {
        asio::async_write(
            impl_->sock, bufs, [total](const std::error_code& e, size_t done) -> size_t { return e ? 0 : total - done; },
            [&](const std::error_code& e, size_t k) { result = e, n = k; });
      },
      deadline, "send to");
  sent_ += total;
}

Frame Connection::receive(Deadline deadline, size_t max_bytes) {
  std::array<uint8_t, 5> hdr{};
  const uint32_t len = impl_->read_header(hdr, deadline);
  if (len == 0 || len - 1 > max_bytes)
    throw NetError(NetError::Kind::kProtocol, "receive from " + impl_->remote + ": frame of " + std::to_string(len) +
                                                  " bytes (at most " + std::to_string(max_bytes + 1) + " expected)");
  Frame f;
  f.type = hdr[4];
  f.payload.resize(len - 1);
  if (len > 1) impl_->read_body(asio::buffer(f.payload.data(), f.payload.size()), f.payload.size(), deadline);
  received_ += 4 + len;
  return f;
}

bool Connection::receive_into(Deadline deadline, uint8_t type, void* head, size_t head_len, void* body,
                              size_t body_len, Frame& other, size_t max_other) {
  std::array<uint8_t, 5> hdr{};
  const uint32_t len = impl_->read_header(hdr, deadline);
  const bool match = len > 0 && hdr[4] == type && uint64_t{len} - 1 == uint64_t{head_len} + body_len;
  if (!match && (len == 0 || len - 1 > max_other))
    throw NetError(NetError::Kind::kProtocol, "receive from " + impl_->remote + ": frame of " + std::to_string(len) +
                                                  " bytes (" + std::to_string(head_len + body_len + 1) + " expected)");
  std::array<asio::mutable_buffer, 2> bufs;
  if (match) {
    bufs = {asio::buffer(head, head_len), asio::buffer(body, body_len)};
  } else {
    other.type = hdr[4];
    other.payload.resize(len - 1);
    bufs = {asio::buffer(other.payload.data(), other.payload.size()), asio::mutable_buffer()};
  }
  if (len > 1) impl_->read_body(bufs, len - 1, deadline);
  received_ += 4 + len;
  return match;
}

void Connection::abort() {
  impl_->aborted = true;
  const int fd = impl_->fd.load();
  if (fd >= 0) ::shutdown(fd, SHUT_RDWR);  // thread-safe; wakes a pending read or write
}

std::string Connection::remote() const { return impl_->remote; }

struct Server::Impl {
  struct Worker {
    std::thread thread;
    std::shared_ptr<Connection> conn;
    std::shared_ptr<std::atomic<bool>> done;
  };
  asio::io_context io;
  asio::ip::tcp::acceptor acceptor{io};
  Handler handler;
  size_t max_connections = 256;
  std::thread accept_thread;
  mutable std::mutex mu;
  std::list<Worker> workers;
  bool stopping = false;
  uint16_t port = 0;
  std::string host;

  void reap_locked() {
    for (auto it = workers.begin(); it != workers.end();) {
      if (it->done->load()) {
        it->thread.join();
        it = workers.erase(it);
      } else {
        ++it;
      }
    }
  }

  void accept_next() {
    auto impl = std::make_shared<std::unique_ptr<Connection::Impl>>(std::make_unique<Connection::Impl>());
    acceptor.async_accept((*impl)->sock, [this, impl](const std::error_code& ec) {
      if (ec) {
        if (ec == asio::error::operation_aborted) return;  // stopping
        accept_next();
        return;
      }
      std::lock_guard<std::mutex> lock(mu);
      if (stopping) return;
      reap_locked();
      if (workers.size() >= max_connections) {
        std::error_code ignore;
        (*impl)->sock.close(ignore);
      } else {
        (*impl)->adopt();
        auto conn = std::shared_ptr<Connection>(new Connection(std::move(*impl)));
        auto done = std::make_shared<std::atomic<bool>>(false);
        Worker w;
        w.conn = conn;
        w.done = done;
        w.thread = std::thread([this, conn, done] {
          try {
            handler(*conn);
          } catch (...) {  // a stream's failure ends that stream only
          }
          done->store(true);
        });
        workers.push_back(std::move(w));
      }
      accept_next();
    });
  }
};

InputError listen_error(const std::string& what, const std::string& listen, int err, const std::string& port_role) {
  const std::string flag = "--" + what.substr(what.rfind('.') + 1);  // hivemind.listen -> --listen
  if (err == EADDRINUSE)
    return InputError(what + " " + listen + ": address in use; choose another port with " + flag +
                      " (another process holds " + port_role + ")");
  if (err == EADDRNOTAVAIL)
    return InputError(what + " " + listen + ": not an address of this host; give " + flag +
                      " one of its addresses, or 0.0.0.0 for all");
  return InputError(what + " '" + listen + "': cannot listen: " + std::strerror(err));
}

Server::Server(const std::string& listen, Handler handler, const std::string& what, size_t max_connections)
    : impl_(std::make_unique<Impl>()) {
  impl_->handler = std::move(handler);
  impl_->max_connections = max_connections;
  const auto [host, port] = split_host_port(listen, what);
  std::error_code ec;
  auto addr = asio::ip::make_address(host, ec);
  PT_INPUT_CHECK(!ec, what, " '", listen, "': not an IP address");
  asio::ip::tcp::endpoint ep(addr, port);
  impl_->acceptor.open(ep.protocol(), ec);
  if (!ec) impl_->acceptor.set_option(asio::ip::tcp::acceptor::reuse_address(true), ec);
  if (!ec) impl_->acceptor.bind(ep, ec);
  if (!ec) impl_->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) throw listen_error(what, listen, ec.value(), "TCP port " + std::to_string(port) + ", for averaging streams");
  impl_->port = impl_->acceptor.local_endpoint().port();
  impl_->host = host == "0.0.0.0" ? "127.0.0.1" : host;
  impl_->accept_next();
  impl_->accept_thread = std::thread([this] { impl_->io.run(); });
}

Server::~Server() { stop(); }

std::string Server::address() const { return impl_->host + ":" + std::to_string(impl_->port); }
uint16_t Server::port() const { return impl_->port; }

size_t Server::live() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  size_t n = 0;
  for (const auto& w : impl_->workers) n += !w.done->load();
  return n;
}

void Server::stop() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->stopping) return;
    impl_->stopping = true;
  }
  asio::post(impl_->io, [this] {
    std::error_code ignore;
    impl_->acceptor.close(ignore);
  });
  if (impl_->accept_thread.joinable()) impl_->accept_thread.join();
  std::list<Impl::Worker> workers;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    workers.swap(impl_->workers);
  }
  for (auto& w : workers) w.conn->abort();
  for (auto& w : workers) w.thread.join();
}

void put_u32(std::string& s, uint32_t v) { s.append(reinterpret_cast<const char*>(&v), 4); }
void put_u64(std::string& s, uint64_t v) { s.append(reinterpret_cast<const char*>(&v), 8); }
void put_f64(std::string& s, double v) { s.append(reinterpret_cast<const char*>(&v), 8); }
void put_str(std::string& s, std::string_view v) {
  put_u32(s, static_cast<uint32_t>(v.size()));
  s.append(v);
}

std::string_view Reader::take(size_t n) {
  if (s_.size() - pos_ < n) throw NetError(NetError::Kind::kProtocol, "short message");
  auto v = s_.substr(pos_, n);
  pos_ += n;
  return v;
}
uint32_t Reader::u32() {
  uint32_t v;
  std::memcpy(&v, take(4).data(), 4);
  return v;
}
uint64_t Reader::u64() {
  uint64_t v;
  std::memcpy(&v, take(8).data(), 8);
  return v;
}
double Reader::f64() {
  double v;
  std::memcpy(&v, take(8).data(), 8);
  return v;
}
std::string Reader::str(size_t max_bytes) {
  const uint32_t n = u32();
  if (n > max_bytes) throw NetError(NetError::Kind::kProtocol, "field of " + std::to_string(n) + " bytes");
  return std::string(take(n));
}

}  // namespace polytrain::hivemind
