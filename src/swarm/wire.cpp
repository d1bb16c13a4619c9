// Connection (wire.h): frames over one TCP stream, each operation with a deadline; the scalar
// packing of frame payloads; the error of a port that cannot be bound. Accepting streams and
// their quotas are server.cpp's.
#include "polytrain/swarm/wire.h"

#include <sys/socket.h>

#include <array>
#include <cerrno>
#include <cstring>

#include "polytrain/common/error.h"
#include "polytrain/swarm/dht.h"
#include "polytrain/swarm/wire_impl.h"

namespace polytrain::hivemind {

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
