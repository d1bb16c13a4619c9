// The c10d rendezvous (TCPStore) and the split of a communicator. libtorch 1.13's TCPStore
// cannot bind MASTER_ADDR: TCPStoreOptions has no address for the server, whose
// Socket::listen(port) binds [::] (dual stack) or else 0.0.0.0 (c10d/socket.h). So rank 0
// checks MASTER_ADDR:MASTER_PORT itself, to name a port in use before the store tries all.
#include "polytrain/parallel/comm/rendezvous.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <utility>
#include <vector>

#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include "polytrain/common/error.h"
#include "polytrain/common/tcp_port.h"
#include "polytrain/parallel/comm/comm_failure.h"

namespace polytrain {

namespace {

void check_port_free(const char* host, const std::string& addr, int port) {
  PT_INPUT_CHECK(tcp_bind_errno(host, port) != EADDRINUSE, addr, ":", port,
                 " (MASTER_ADDR:MASTER_PORT): address in use: another job holds it; pass --master_port with a free "
                 "port");
}

// c10d logs each failed bind and connect try through glog on stderr: three lines for a busy
// port on rank 0, one a second on the other ranks until rank 0 is up, on every rank's console.
// Polytrain's own error line says what failed, so they are off while a store is created (c10d's
// LOG_IF reads c10's level); TORCH_CPP_LOG_LEVEL, as in PyTorch, keeps them (on stderr, and
// so in launch --log_dir's rank logs).
class QuietC10dLog {
 public:
  QuietC10dLog() {
    static std::once_flag once;
    std::call_once(once, [] {
      if (std::getenv("TORCH_CPP_LOG_LEVEL") != nullptr) c10::initLogging();  // C++ programs skip it
    });
    if (std::getenv("TORCH_CPP_LOG_LEVEL") != nullptr) return;
    std::lock_guard<std::mutex> lock(mu());
    if (depth()++ == 0) saved() = std::exchange(FLAGS_caffe2_log_level, kAboveError);
    active_ = true;
  }
  ~QuietC10dLog() {
    if (!active_) return;
    std::lock_guard<std::mutex> lock(mu());
    if (--depth() == 0) FLAGS_caffe2_log_level = saved();
  }
  QuietC10dLog(const QuietC10dLog&) = delete;
  QuietC10dLog& operator=(const QuietC10dLog&) = delete;

 private:
  static constexpr int kAboveError = 3;  // glog's FATAL: c10d logs nothing at that level
  // Shared by the threads that create stores at once (ranks as threads in tests).
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static int& depth() {
    static int d = 0;
    return d;
  }
  static int& saved() {
    static int s = 0;
    return s;
  }
  bool active_ = false;
};

}  // namespace

SplitPlace split_place(Communicator& comm, int color, int key, const c10::Device& device) {
  const int size = comm.size();
  auto opts = torch::TensorOptions().dtype(torch::kLong).device(device);
  auto mine = torch::tensor({static_cast<int64_t>(color), static_cast<int64_t>(key)}, torch::kLong).to(device);
  auto all = torch::empty({2 * size}, opts);
  comm.all_gather(all, mine);
  const auto host = all.cpu();
  const int64_t* v = host.data_ptr<int64_t>();
  std::vector<std::pair<int64_t, int>> members;  // (key, old rank) of my colour
  for (int r = 0; r < size; ++r)
    if (v[2 * r] == color) members.emplace_back(v[2 * r + 1], r);
  std::sort(members.begin(), members.end());
  SplitPlace place{0, static_cast<int>(members.size())};
  for (size_t i = 0; i < members.size(); ++i)
    if (members[i].second == comm.rank()) place.rank = static_cast<int>(i);
  return place;
}

std::string first_line(const std::exception& e) {
  std::string msg = e.what();
  if (auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);
  return msg;
}

C10dWork::C10dWork(c10::intrusive_ptr<c10d::Work> work, std::string what, std::function<void()> then,
                   bool wait_on_destroy)
    : work_(std::move(work)), what_(std::move(what)), then_(std::move(then)), wait_on_destroy_(wait_on_destroy) {}

C10dWork::~C10dWork() {
  if (work_ && wait_on_destroy_) {
    try {
      work_->wait();
    } catch (...) {  // a destructor reports nothing; wait() is where failures surface
    }
  }
}

void C10dWork::wait() {
  if (!work_) return;
  auto w = std::exchange(work_, {});
  try {
    w->wait();
  } catch (const std::exception& e) {
    throw CommFailure(detail::cat(what_, " failed: ", first_line(e)));
  }
  if (then_) std::exchange(then_, {})();
}

c10::intrusive_ptr<c10d::Store> rendezvous_store(const std::string& engine, int rank, int size,
                                                 const std::string& addr, int port,
                                                 std::chrono::milliseconds timeout) {
  PT_INPUT_CHECK(size >= 1 && rank >= 0 && rank < size, engine, ": rank ", rank, " is not in a group of ", size);
  PT_INPUT_CHECK(port > 0 && port < 65536, "MASTER_PORT=", port, " is not a TCP port");
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(port);
  so.isServer = rank == 0;
  so.numWorkers = size;
  so.waitWorkers = false;
  so.timeout = timeout;
  if (rank == 0) check_port_free(addr.c_str(), addr, port);
  try {
    const QuietC10dLog quiet;
    return c10::make_intrusive<c10d::TCPStore>(addr, so);
  } catch (const std::exception& e) {
    // Free on MASTER_ADDR, taken on another address of this host (the store binds them all).
    if (rank == 0) check_port_free(nullptr, addr, port);
    throw Error(detail::cat(engine, ": rank ", rank, " of ", size, " could not ", rank == 0 ? "host" : "reach",
                            " the rendezvous at ", addr, ":", port, ": ", first_line(e)));
  }
}

}  // namespace polytrain
