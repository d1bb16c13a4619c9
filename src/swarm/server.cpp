// A TCP listener (wire.h: Server): accepts streams, runs each on its own thread, and keeps them
// within StreamLimits (per address, per service, pending, a lifetime), so that a newcomer
// opening or holding hundreds of streams cannot starve the swarm's own rounds. The frames
// themselves are wire.cpp's.
#include <sys/ioctl.h>

#include <array>
#include <cstdio>
#include <list>
#include <memory>
#include <mutex>
#include <thread>

#include "polytrain/swarm/dht.h"
#include "polytrain/swarm/wire.h"
#include "polytrain/swarm/wire_impl.h"

namespace polytrain::hivemind {

const StreamLimits::Service& StreamLimits::service(uint8_t type) const {
  auto it = services.find(type);
  return it == services.end() ? per_service : it->second;
}

namespace {

enum Complaint { kIp, kFull, kEvicted, kService, kExpired, kComplaints };

// One stderr line per reason every 5 s at most: a flood of refused streams must not become a
// flood of log lines. The line says how many like it were left out since the last one.
class Complaints {
 public:
  void say(Complaint c, const std::string& line) {
    const auto now = Clock::now();
    if (last_[c] != Clock::time_point{} && now - last_[c] < std::chrono::seconds(5)) {
      ++quiet_[c];
      return;
    }
    const std::string more = quiet_[c] ? " (" + std::to_string(quiet_[c]) + " more like it not logged)" : "";
    std::fprintf(stderr, "hivemind: %s%s\n", line.c_str(), more.c_str());
    last_[c] = now, quiet_[c] = 0;
  }

 private:
  std::array<Clock::time_point, kComplaints> last_{};
  std::array<uint64_t, kComplaints> quiet_{};
};

std::string seconds(std::chrono::milliseconds d) {
  char b[32];
  std::snprintf(b, sizeof b, "%g s", d.count() / 1000.0);
  return b;
}

}  // namespace

struct Server::Impl {
  // A stream's place in the quotas (guarded by mu).
  struct Slot {
    std::string ip;
    Clock::time_point accepted;
    Deadline ends;         // aborted then: first_frame while pending, then its service's lifetime
    int service = -1;      // the first frame's type; -1 while pending
    bool closing = false;  // aborted or refused by the server: no longer holds a place
  };
  struct Worker {
    std::thread thread;
    std::shared_ptr<Connection> conn;
    std::shared_ptr<std::atomic<bool>> done;
    std::shared_ptr<Slot> slot;
  };
  asio::io_context io;
  asio::ip::tcp::acceptor acceptor{io};
  asio::steady_timer sweep_timer{io};
  Handler handler;
  StreamLimits limits;
  std::thread accept_thread;
  mutable std::mutex mu;
  std::list<Worker> workers;
  StreamCounts counts;
  Complaints complaints;
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

  // Streams that hold a place now and satisfy `pred`.
  template <typename Pred>
  size_t held(Pred pred) const {
    size_t n = 0;
    for (const auto& w : workers) n += !w.done->load() && !w.slot->closing && pred(*w.slot);
    return n;
  }

  void close_locked(Worker& w, Complaint why, const std::string& line) {
    w.slot->closing = true;
    w.conn->abort();
    complaints.say(why, line);
  }

  // A new stream needs a place: a stream whose first frame has not come gives its place up,
  // the oldest of those that sent no byte at all first. Honest peers send their first frame
  // with the connection, before their handler thread may have read it; a silent one is the
  // likeliest attacker.
  void evict_oldest_pending_locked() {
    Worker* oldest = nullptr;
    bool oldest_silent = false;
    for (auto& w : workers) {
      if (w.done->load() || w.slot->closing || w.slot->service >= 0) continue;
      int queued = 0;
      const bool silent = ::ioctl(w.conn->impl_->fd.load(), FIONREAD, &queued) == 0 && queued == 0;
      if (!oldest || (silent && !oldest_silent) ||
          (silent == oldest_silent && w.slot->accepted < oldest->slot->accepted))
        oldest = &w, oldest_silent = silent;
    }
    if (!oldest) return;
    ++counts.evicted_pending;
    close_locked(*oldest, kEvicted,
                 "closed a stream from " + oldest->slot->ip + " that sent nothing yet, to make room for a new one (" +
                     std::to_string(limits.max_pending) + " pending streams at most)");
  }

  // Whether a stream from `ip` may start now; refusals are counted and logged.
  bool admit_locked(const std::string& ip) {
    if (held([&](const Slot& s) { return s.ip == ip; }) >= limits.per_ip) {
      ++counts.refused_ip;
      complaints.say(kIp, "refused a stream from " + ip + ": it holds " + std::to_string(limits.per_ip) +
                              " streams already (the per-address quota)");
      return false;
    }
    auto pending = [](const Slot& s) { return s.service < 0; };
    auto any = [](const Slot&) { return true; };
    if (held(pending) >= limits.max_pending || held(any) >= limits.max_streams) evict_oldest_pending_locked();
    if (held(any) >= limits.max_streams) {
      ++counts.refused_full;
      complaints.say(kFull, "refused a stream from " + ip + ": all " + std::to_string(limits.max_streams) +
                                " stream slots are taken");
      return false;
    }
    return true;
  }

  // The stream's first frame names its service: it takes a place of that service's quota, and
  // lives at most that service's lifetime.
  void classify(Slot& slot, uint8_t type) {
    std::lock_guard<std::mutex> lock(mu);
    if (slot.closing) throw NetError(NetError::Kind::kClosed, "stream from " + slot.ip + " closed");
    const StreamLimits::Service& svc = limits.service(type);
    if (held([type](const Slot& s) { return s.service == type; }) >= svc.max_streams) {
      slot.closing = true;
      ++counts.refused_service;
      complaints.say(kService, "refused a stream from " + slot.ip + ": service " + std::to_string(type) +
                                   " holds " + std::to_string(svc.max_streams) + " streams already (its quota)");
      throw NetError(NetError::Kind::kClosed, "stream from " + slot.ip + " refused: service quota");
    }
    slot.service = type;
    slot.ends = slot.accepted + svc.lifetime;
  }

  void start_locked(std::unique_ptr<Connection::Impl> ci, const std::string& ip) {
    Worker w;
    w.slot = std::make_shared<Slot>();
    w.slot->ip = ip;
    w.slot->accepted = Clock::now();
    w.slot->ends = w.slot->accepted + limits.first_frame;
    ci->on_first_type = [this, slot = w.slot](uint8_t type) { classify(*slot, type); };
    w.conn = std::shared_ptr<Connection>(new Connection(std::move(ci)));
    w.done = std::make_shared<std::atomic<bool>>(false);
    w.thread = std::thread([this, conn = w.conn, done = w.done] {
      try {
        handler(*conn);
      } catch (...) {  // a stream's failure ends that stream only
      }
      conn->abort();  // the other side learns now, not when the stream is reaped
      done->store(true);
    });
    workers.push_back(std::move(w));
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
      std::error_code e;
      const auto ep = (*impl)->sock.remote_endpoint(e);
      const std::string ip = e ? "?" : ep.address().to_string();
      if (admit_locked(ip)) {
        (*impl)->adopt();
        start_locked(std::move(*impl), ip);
      } else {
        (*impl)->sock.close(e);
      }
      accept_next();
    });
  }

  // Every 100 ms: streams past their deadline (no first frame in time, or their service's
  // lifetime) are aborted, whatever their handler is waiting for.
  void sweep() {
    sweep_timer.expires_after(std::chrono::milliseconds(100));
    sweep_timer.async_wait([this](const std::error_code& ec) {
      if (ec) return;  // stopping
      std::lock_guard<std::mutex> lock(mu);
      if (stopping) return;
      const auto now = Clock::now();
      for (auto& w : workers) {
        const Slot& s = *w.slot;
        if (w.done->load() || s.closing || now < s.ends) continue;
        ++counts.expired;
        close_locked(w, kExpired,
                     s.service < 0 ? "closed a stream from " + s.ip + ": no first frame within " +
                                         seconds(limits.first_frame)
                                   : "closed a stream from " + s.ip + " (service " + std::to_string(s.service) +
                                         ") at its lifetime of " + seconds(limits.service(s.service).lifetime));
      }
      reap_locked();
      sweep();
    });
  }
};

Server::Server(const std::string& listen, Handler handler, const std::string& what, StreamLimits limits)
    : impl_(std::make_unique<Impl>()) {
  impl_->handler = std::move(handler);
  impl_->limits = std::move(limits);
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
  impl_->sweep();
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

StreamCounts Server::counts() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->counts;
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
    impl_->sweep_timer.cancel();
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

}  // namespace polytrain::hivemind
