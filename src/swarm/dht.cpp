// The only translation unit that includes <opendht.h> (about 8 s and 400 MB to compile).
#include "polytrain/swarm/dht.h"

#include <opendht.h>
#include <opendht/default_types.h>
#include <opendht/network_utils.h>
#include <opendht/securedht.h>

#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "polytrain/common/crc32c.h"
#include "polytrain/common/error.h"
#include "polytrain/swarm/msgpack_fields.h"
#include "polytrain/swarm/wire.h"

namespace polytrain::hivemind {
namespace {

constexpr dht::ValueType::Id kRecordType = 0x5054;  // "PT"
constexpr auto kRecordTypeExpiration = std::chrono::minutes(5);
constexpr int64_t kMaxTtlMs = 5 * 60 * 1000;
// What an OpenDHT packet can be: a UDP payload (values larger than 600 bytes travel in parts,
// which allowed_packet drops), nested a few levels (message, args, values, value, body).
constexpr size_t kMaxDatagram = 65'507;
constexpr int kMaxDepth = 16;

std::string blob_view(const dht::Blob& b) { return std::string(reinterpret_cast<const char*>(b.data()), b.size()); }

std::string hash_bytes(const dht::InfoHash& h) { return std::string(reinterpret_cast<const char*>(h.data()), h.size()); }

// The value of `key` in msgpack map `m` (nullptr when absent or m is not a map).
const msgpack::object* find_key(const msgpack::object& m, std::string_view key) {
  if (m.type != msgpack::type::MAP) return nullptr;
  for (uint32_t i = 0; i < m.via.map.size; ++i) {
    const auto& kv = m.via.map.ptr[i];
    if (kv.key.type == msgpack::type::STR && std::string_view(kv.key.via.str.ptr, kv.key.via.str.size) == key)
      return &kv.val;
  }
  return nullptr;
}

bool is_str(const msgpack::object* o, std::string_view s) {
  return o && o->type == msgpack::type::STR && std::string_view(o->via.str.ptr, o->via.str.size) == s;
}

// Whether an incoming OpenDHT packet may reach the node. A swarm node stores only polytrain
// records, and OpenDHT 2.4.12's SecureDht stores any validly signed value whatever the type's
// store policy says (its secure store policy returns the signature check without asking the
// type), after which an unsigned value reusing that value's id crashes the node in the secure
// edit policy (null owner). So a put must carry only unsigned, unowned, unencrypted values of
// the record type in the packet itself; puts of values sent in parts (larger than a UDP
// packet; records never are) and the parts themselves are dropped too. Other messages (ping,
// find, get, listen, refresh, replies) pass.
// Every packet is first checked by fields::bounded_msgpack (declared sizes backed by bytes,
// depth <= 16, no trailing bytes), so parsing one costs at most ~24 bytes per byte received;
// the unpack_limit below says the same to msgpack itself, should the two ever disagree.
bool allowed_packet(const uint8_t* data, size_t size) {
  if (size > kMaxDatagram || !fields::bounded_msgpack(reinterpret_cast<const char*>(data), size, kMaxDepth))
    return false;
  try {
    size_t off = 0;
    const auto n = static_cast<uint32_t>(size);
    msgpack::object_handle oh = msgpack::unpack(reinterpret_cast<const char*>(data), size, off, nullptr, nullptr,
                                                msgpack::unpack_limit(n, n / 2, n, n, n, kMaxDepth + 1));
    if (off != size) return false;
    const msgpack::object& msg = oh.get();
    if (msg.type != msgpack::type::MAP) return false;
    if (is_str(find_key(msg, "y"), "v")) return false;  // value parts
    if (!is_str(find_key(msg, "q"), "put")) return true;
    const msgpack::object* args = find_key(msg, "a");
    const msgpack::object* values = args ? find_key(*args, "values") : nullptr;
    if (!values || values->type != msgpack::type::ARRAY) return false;
    for (uint32_t i = 0; i < values->via.array.size; ++i) {
      const msgpack::object& v = values->via.array.ptr[i];
      const msgpack::object* dat = find_key(v, "dat");  // not a map: sizes of parts
      if (!dat || dat->type != msgpack::type::MAP || find_key(*dat, "sig")) return false;
      const msgpack::object* body = find_key(*dat, "body");
      if (!body || body->type != msgpack::type::MAP || find_key(*body, "owner") || find_key(*body, "to")) return false;
      const msgpack::object* type = find_key(*body, "type");
      if (!type || type->type != msgpack::type::POSITIVE_INTEGER || type->via.u64 != kRecordType) return false;
    }
    return true;
  } catch (const std::exception&) {
    return false;  // what msgpack cannot parse, OpenDHT cannot either
  }
}

// OpenDHT's UDP socket with allowed_packet() in front of the node.
class FilteringSocket : public dht::net::DatagramSocket {
 public:
  FilteringSocket(const dht::SockAddr& bind4, const dht::SockAddr& bind6, std::function<void()> on_drop)
      : inner_(std::make_unique<dht::net::UdpSocket>(bind4, bind6)), on_drop_(std::move(on_drop)) {
    inner_->setOnReceive([this](dht::net::PacketList&& packets) {
      for (auto it = packets.begin(); it != packets.end();) {
        if (allowed_packet(it->data.data(), it->data.size())) {
          ++it;
        } else {
          it = packets.erase(it);
          on_drop_();
        }
      }
      if (!packets.empty()) onReceived(std::move(packets));
      return dht::net::PacketList{};
    });
  }
  ~FilteringSocket() override { inner_->stop(); }
  int sendTo(const dht::SockAddr& dest, const uint8_t* data, size_t size, bool replied) override {
    return inner_->sendTo(dest, data, size, replied);
  }
  const dht::SockAddr& getBoundRef(sa_family_t family) const override { return inner_->getBoundRef(family); }
  bool hasIPv4() const override { return inner_->hasIPv4(); }
  bool hasIPv6() const override { return inner_->hasIPv6(); }
  void stop() override { inner_->stop(); }

 private:
  std::unique_ptr<dht::net::UdpSocket> inner_;
  std::function<void()> on_drop_;
};

// errno of binding a UDP socket to `addr` as OpenDHT does (no SO_REUSEADDR), 0 when it binds:
// OpenDHT logs the reason to a logger a swarm node has none of, and throws "Can't bind socket".
int udp_bind_errno(const dht::SockAddr& addr) {
  const int fd = ::socket(addr.getFamily(), SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return errno;
  const int err = ::bind(fd, addr.get(), addr.getLength()) == 0 ? 0 : errno;
  ::close(fd);
  return err;
}

[[noreturn]] void throw_dht_bind_error(const std::string& listen, const dht::SockAddr& addr, const std::string& why) {
  const int err = udp_bind_errno(addr);
  if (err == 0) throw InputError("hivemind.listen '" + listen + "': cannot bind the DHT socket: " + why);
  throw listen_error("hivemind.listen", listen, err, "UDP port " + std::to_string(addr.getPort()) + ", the DHT's");
}

}  // namespace

bool datagram_allowed(const uint8_t* data, size_t size) { return allowed_packet(data, size); }

std::pair<std::string, uint16_t> split_host_port(const std::string& s, const std::string& what) {
  std::string host;
  std::string port;
  if (!s.empty() && s.front() == '[') {
    const auto close = s.find(']');
    PT_INPUT_CHECK(close != std::string::npos && close + 1 < s.size() && s[close + 1] == ':', what, " '", s,
                   "': expected [IPV6]:PORT");
    host = s.substr(1, close - 1), port = s.substr(close + 2);
  } else {
    const auto colon = s.rfind(':');
    PT_INPUT_CHECK(colon != std::string::npos && colon > 0, what, " '", s, "': expected HOST:PORT");
    host = s.substr(0, colon), port = s.substr(colon + 1);
  }
  PT_INPUT_CHECK(!port.empty() && port.size() <= 5 && port.find_first_not_of("0123456789") == std::string::npos &&
                     std::stoi(port) <= 65535,
                 what, " '", s, "': port must be a number in 0..65535");
  for (char c : host)
    PT_INPUT_CHECK(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == ':' || c == '_', what,
                   " '", s, "': the host has a character that no address or host name has");
  return {host, static_cast<uint16_t>(std::stoi(port))};
}

struct DhtNode::Impl {
  dht::DhtRunner runner;
  RejectCounts rejected;
  ReplayGuard stored_counters;  // what this node stored (a value older than it is refused)
  ReplayGuard read_counters;    // what this peer read
  uint32_t network = 0;
  std::mutex mu;
  std::map<std::string, uint64_t> counters;  // this peer's last counter per (key, kind)

  // Opens a value found in or offered to the DHT under `key`. Counted when refused.
  std::optional<Record> open(const dht::InfoHash& key, const dht::Value& v) {
    Reject why = Reject::kNone;
    std::optional<Record> r;
    if (v.type != kRecordType || v.isSigned() || v.isEncrypted()) {
      why = Reject::kSchema;
    } else {
      Opened o = open_record(blob_view(v.data), hash_bytes(key), unix_ms(), kMaxTtlMs);
      why = o.why;
      if (o.record && v.id != slot_id(o.record->owner, o.record->kind)) why = Reject::kWrongSlot;
      if (why == Reject::kNone) r = std::move(o.record);
    }
    if (why != Reject::kNone) rejected.add(why);
    return r;
  }

  void register_types() {
    // Records: opened on store, and on edit the new one must come from the same owner with a
    // higher counter (or be the same record again, as OpenDHT's refreshes send it).
    dht::ValueType record_type(
        kRecordType, "polytrain record", kRecordTypeExpiration,
        [this](dht::InfoHash key, std::shared_ptr<dht::Value>& v, const dht::InfoHash&, const dht::SockAddr&) {
          auto r = open(key, *v);
          if (!r) return false;
          if (!stored_counters.accept(hash_bytes(key), *r, unix_ms())) {
            rejected.add(Reject::kReplay);
            return false;
          }
          return true;
        },
        [this](dht::InfoHash key, const std::shared_ptr<dht::Value>& old_v, std::shared_ptr<dht::Value>& new_v,
               const dht::InfoHash&, const dht::SockAddr&) {
          if (!old_v || !new_v) return false;
          auto r = open(key, *new_v);
          if (!r) return false;
          // The old value was opened when stored; the slot id binds it to its owner and kind.
          if (old_v->type != kRecordType || old_v->id != new_v->id) {
            rejected.add(Reject::kWrongSlot);
            return false;
          }
          Opened old = open_record(blob_view(old_v->data), hash_bytes(key), 0, INT64_MAX);
          if (old.record && (old.record->owner != r->owner || r->counter < old.record->counter ||
                             (r->counter == old.record->counter && old_v->data != new_v->data))) {
            rejected.add(old.record->owner != r->owner ? Reject::kWrongSlot : Reject::kReplay);
            return false;
          }
          stored_counters.accept(hash_bytes(key), *r, unix_ms());
          return true;
        });
    runner.registerType(record_type);
    // OpenDHT's own types (user data, certificates, IM, ...) store nothing on a swarm node.
    auto refuse_store = [this](dht::InfoHash, std::shared_ptr<dht::Value>&, const dht::InfoHash&,
                               const dht::SockAddr&) {
      rejected.add(Reject::kSchema);
      return false;
    };
    auto refuse_edit = [this](dht::InfoHash, const std::shared_ptr<dht::Value>&, std::shared_ptr<dht::Value>&,
                              const dht::InfoHash&, const dht::SockAddr&) {
      rejected.add(Reject::kSchema);
      return false;
    };
    auto replace = [&](const dht::ValueType& t) {
      runner.registerType(dht::ValueType(t.id, t.name, t.expiration, refuse_store, refuse_edit));
    };
    for (const dht::ValueType& t : dht::DEFAULT_TYPES) replace(t);
    for (const dht::ValueType& t : dht::DEFAULT_INSECURE_TYPES) replace(t);
    replace(dht::CERTIFICATE_TYPE);
  }
};

std::string DhtNode::key_bytes(const std::string& key) { return hash_bytes(dht::InfoHash::get(key)); }

DhtNode::DhtNode(const DhtOptions& options, std::shared_ptr<const Identity> identity)
    : identity_(std::move(identity)), impl_(std::make_unique<Impl>()) {
  PT_INPUT_CHECK(!options.run_id.empty(), "hivemind.run_id is empty: every peer of a swarm names the same run_id");
  const auto [host, port] = split_host_port(options.listen, "hivemind.listen");
  std::vector<dht::SockAddr> bind;
  try {
    bind = dht::SockAddr::resolve(host, std::to_string(port));
  } catch (const std::exception& e) {
    throw InputError("hivemind.listen '" + options.listen + "': " + e.what());
  }
  PT_INPUT_CHECK(!bind.empty(), "hivemind.listen '", options.listen, "': the host does not resolve");
  const std::string net_name = "polytrain/hivemind/" + options.run_id;
  impl_->network = crc32c(net_name.data(), net_name.size());
  dht::DhtRunner::Config config;
  config.threaded = true;
  config.dht_config.node_config.network = impl_->network;
  config.dht_config.node_config.max_store_size = 16 << 20;  // a swarm's records are small
  config.dht_config.node_config.max_store_keys = 4096;
  for (const auto& a : bind)
    if (a.getFamily() == AF_INET) config.bind4 = a;
  PT_INPUT_CHECK(config.bind4.getFamily() == AF_INET, "hivemind.listen '", options.listen, "': not an IPv4 address");
  config.bind6 = dht::SockAddr();
  try {
    dht::DhtRunner::Context context;
    Impl* impl = impl_.get();
    context.sock = std::make_unique<FilteringSocket>(config.bind4, config.bind6,
                                                     [impl] { impl->rejected.add(Reject::kSchema); });
    impl_->runner.run(config, std::move(context));
  } catch (const std::exception& e) {
    throw_dht_bind_error(options.listen, config.bind4, e.what());
  }
  if (impl_->runner.getBoundPort(AF_INET) == 0)
    throw_dht_bind_error(options.listen, config.bind4, "no port was bound");
  impl_->register_types();
  if (options.initial_peers.empty()) return;
  // Join: ping every initial peer; one answer is enough.
  auto answered = std::make_shared<std::promise<void>>();
  auto once = std::make_shared<std::atomic<bool>>(false);
  for (const auto& p : options.initial_peers) {
    const auto [h, pt] = split_host_port(p, "hivemind.initial_peers");
    std::vector<dht::SockAddr> addrs;
    try {
      addrs = dht::SockAddr::resolve(h, std::to_string(pt));
    } catch (const std::exception& e) {
      throw InputError("hivemind.initial_peers '" + p + "': " + e.what());
    }
    PT_INPUT_CHECK(!addrs.empty(), "hivemind.initial_peers '", p, "': the host does not resolve");
    for (const auto& a : addrs)
      if (a.getFamily() == AF_INET)
        impl_->runner.bootstrap(a, [answered, once](bool ok) {
          if (ok && !once->exchange(true)) answered->set_value();
        });
  }
  if (answered->get_future().wait_for(options.bootstrap_timeout) != std::future_status::ready) {
    impl_->runner.join();
    std::string all;
    for (const auto& p : options.initial_peers) all += (all.empty() ? "" : ",") + p;
    throw InputError("hivemind.initial_peers: no answer from " + all + " within " +
                     std::to_string(options.bootstrap_timeout.count()) +
                     " ms (is a peer of run_id '" + options.run_id + "' listening there?)");
  }
}

DhtNode::~DhtNode() {
  try {
    impl_->runner.join();  // stops the threads and closes the socket now (no goodbye round)
  } catch (...) {
  }
}

std::string DhtNode::address() const {
  dht::SockAddr a = impl_->runner.getBound(AF_INET);
  std::string host = a.toString();
  const auto colon = host.rfind(':');
  if (colon != std::string::npos) host = host.substr(0, colon);
  if (host == "0.0.0.0") host = "127.0.0.1";
  return host + ":" + std::to_string(impl_->runner.getBoundPort(AF_INET));
}

uint32_t DhtNode::network_id() const { return impl_->network; }

const RejectCounts& DhtNode::rejected() const { return impl_->rejected; }

unsigned DhtNode::good_nodes() const {
  unsigned good = 0, dubious = 0, cached = 0, incoming = 0;
  impl_->runner.getNodesStats(AF_INET, &good, &dubious, &cached, &incoming);
  return good;
}

bool DhtNode::store(const std::string& key, const std::string& kind, const std::string& payload,
                    std::chrono::milliseconds ttl, std::chrono::milliseconds deadline) {
  PT_CHECK(ttl >= std::chrono::seconds(11) && ttl.count() <= kMaxTtlMs, "record ttl ", ttl.count(), " ms");
  Record r;
  r.kind = kind;
  r.payload = payload;
  r.expiry_ms = unix_ms() + ttl.count();
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    uint64_t& c = impl_->counters[key + '\0' + kind];
    r.counter = c = next_counter(c);
  }
  const auto hash = dht::InfoHash::get(key);
  const std::string sealed = seal_record(r, *identity_, hash_bytes(hash));
  auto value = std::make_shared<dht::Value>(kRecordType, reinterpret_cast<const uint8_t*>(sealed.data()),
                                            sealed.size(), slot_id(identity_->public_key(), kind));
  auto done = std::make_shared<std::promise<bool>>();
  auto fired = std::make_shared<std::atomic<bool>>(false);
  impl_->runner.put(hash, value, [done, fired](bool ok, const std::vector<std::shared_ptr<dht::Node>>&) {
    if (!fired->exchange(true)) done->set_value(ok);
  });
  auto f = done->get_future();
  return f.wait_for(deadline) == std::future_status::ready && f.get();
}

std::vector<Record> DhtNode::fetch(const std::string& key, std::chrono::milliseconds deadline) {
  // A node that knows no other node (the first peer, before anyone joined) has nothing to
  // read. It must not search either: measured on OpenDHT 2.4.12, gets on a node alone leave it
  // unable to take the records of peers that join later (they stay invisible to it for 20 s
  // and more, and its routing table shows no good node).
  unsigned good = 0, dubious = 0, cached = 0, incoming = 0;
  impl_->runner.getNodesStats(AF_INET, &good, &dubious, &cached, &incoming);
  if (good + dubious + incoming == 0) return {};
  const auto hash = dht::InfoHash::get(key);
  struct Shared {
    std::mutex mu;
    std::vector<std::shared_ptr<dht::Value>> values;
    std::promise<void> done;
    std::atomic<bool> fired{false};
  };
  auto s = std::make_shared<Shared>();
  impl_->runner.get(
      hash,
      [s](const std::vector<std::shared_ptr<dht::Value>>& vals) {
        std::lock_guard<std::mutex> lock(s->mu);
        if (s->values.size() < 4096) s->values.insert(s->values.end(), vals.begin(), vals.end());
        return true;
      },
      [s](bool, const std::vector<std::shared_ptr<dht::Node>>&) {
        if (!s->fired.exchange(true)) s->done.set_value();
      });
  s->done.get_future().wait_for(deadline);
  std::vector<std::shared_ptr<dht::Value>> values;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    values = s->values;
  }
  // Newest per (owner, kind); older ones (a replay served by some node) are dropped.
  std::map<std::pair<PublicKey, std::string>, Record> newest;
  const std::string kb = hash_bytes(hash);
  for (const auto& v : values) {
    if (!v) continue;
    auto r = impl_->open(hash, *v);
    if (!r) continue;
    if (!impl_->read_counters.accept(kb, *r, unix_ms())) {
      impl_->rejected.add(Reject::kReplay);
      continue;
    }
    auto k = std::make_pair(r->owner, r->kind);
    auto it = newest.find(k);
    if (it == newest.end() || it->second.counter < r->counter) newest[k] = std::move(*r);
  }
  std::vector<Record> out;
  out.reserve(newest.size());
  for (auto& [k, r] : newest) out.push_back(std::move(r));
  return out;
}

}  // namespace polytrain::hivemind
