#include "polytrain/parallel/comm/rendezvous.h"

#include <algorithm>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include "polytrain/common/error.h"

namespace polytrain {

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
    throw Error(detail::cat(what_, " failed: ", first_line(e)));
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
  try {
    return c10::make_intrusive<c10d::TCPStore>(addr, so);
  } catch (const std::exception& e) {
    throw Error(detail::cat(engine, ": rank ", rank, " of ", size, " could not ", rank == 0 ? "host" : "reach",
                            " the rendezvous at ", addr, ":", port, ": ", first_line(e)));
  }
}

}  // namespace polytrain
