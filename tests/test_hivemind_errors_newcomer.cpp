// A swarm peer's busy --listen port (issue 44): "address in use", naming the flag that changes
// it, for the DHT's UDP socket and for the averaging streams' TCP listener on the same port,
// in-process and through the programs (exit code 2, one error line). Built with hivemind only
// (CMake builds test_hivemind_*.cpp only then); the rest of issue 44's errors:
// test_errors_newcomer.cpp.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <fstream>
#include <memory>
#include <string>

#include "helpers/free_port.h"
#include "helpers/program.h"
#include "helpers/require.h"
#include "helpers/temp_dir.h"
#include "polytrain/common/error.h"
#include "polytrain/swarm/dht.h"
#include "polytrain/swarm/record.h"
#include "polytrain/swarm/wire.h"

namespace hm = polytrain::hivemind;

namespace {

// A socket of `type` bound (and, for TCP, listening) on 127.0.0.1:<any port>, held while it lives.
class BusyPort {
 public:
  int port = -1;
  explicit BusyPort(int type) : fd_(::socket(AF_INET, type | SOCK_CLOEXEC, 0)) {
    sockaddr_in a = polytrain::testing::loopback();
    socklen_t len = sizeof a;
    if (fd_ >= 0 && ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
        (type != SOCK_STREAM || ::listen(fd_, 4) == 0) &&
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) == 0)
      port = ntohs(a.sin_port);
  }
  BusyPort(const BusyPort&) = delete;
  BusyPort& operator=(const BusyPort&) = delete;
  ~BusyPort() {
    if (fd_ >= 0) ::close(fd_);
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port); }

 private:
  int fd_;
};

std::shared_ptr<hm::Identity> identity() {
  std::array<uint8_t, 32> seed{};
  seed.fill(44);
  return std::make_shared<hm::Identity>(hm::Identity::from_seed(seed));
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const polytrain::InputError& e) {
    return e.what();
  }
  return "no InputError";
}

TEST(ListenPort, ABusyUdpPortIsAddressInUseNamingListen) {
  const BusyPort busy(SOCK_DGRAM);
  ASSERT_GT(busy.port, 0);
  hm::DhtOptions o;
  o.run_id = "newcomer";
  o.listen = busy.address();
  EXPECT_EQ(error_of([&] { hm::DhtNode node(o, identity()); }),
            "hivemind.listen " + busy.address() + ": address in use; choose another port with --listen (another "
            "process holds UDP port " + std::to_string(busy.port) + ", the DHT's)");
}

TEST(ListenPort, ABusyTcpPortIsAddressInUseNamingListen) {
  const BusyPort busy(SOCK_STREAM);
  ASSERT_GT(busy.port, 0);
  EXPECT_EQ(error_of([&] { hm::Server server(busy.address(), [](hm::Connection&) {}); }),
            "hivemind.listen " + busy.address() + ": address in use; choose another port with --listen (another "
            "process holds TCP port " + std::to_string(busy.port) + ", for averaging streams)");
}

TEST(ListenPort, AnAddressOfAnotherHostIsNamedAsSuch) {
  hm::DhtOptions o;
  o.run_id = "newcomer";
  o.listen = "192.0.2.1:0";  // TEST-NET-1 (RFC 5737): no host has it
  EXPECT_EQ(error_of([&] { hm::DhtNode node(o, identity()); }),
            "hivemind.listen 192.0.2.1:0: not an address of this host; give --listen one of its addresses, or "
            "0.0.0.0 for all");
}

TEST(ListenPort, TheProgramsSayItInOneLine) {
  const std::string a = polytrain::testing::asset_cache();
  PT_SKIP_UNLESS(std::ifstream(a + "/gpt2/encoder.json").good(), "assets (scripts/fetch_assets.sh)");
  const polytrain::testing::TempDir tmp;
  {
    const BusyPort busy(SOCK_DGRAM);
    const auto r = polytrain::testing::run_program(POLYTRAIN_BINARY_DIR "/hivemind_monitor --run_id newcomer --listen " +
                                                   busy.address() + " --log_dir " + tmp.str("monitor"));
    polytrain::testing::expect_one_line_error(
        r, "hivemind.listen " + busy.address() + ": address in use; choose another port with --listen");
    EXPECT_EQ(r.out.find("Can't bind"), std::string::npos) << r.out;
  }
  // The DHT's UDP port is free; the averaging streams' TCP listener on the same number is not.
  const BusyPort busy(SOCK_STREAM);
  std::string text;
  for (int i = 0; i < 200; ++i) text += "Call me Ishmael. Some years ago, never mind how long precisely.\n";
  const std::string train = tmp.write("train.txt", text);  // blocks of 128 tokens for a first batch
  const auto r = polytrain::testing::run_program(
      POLYTRAIN_BINARY_DIR "/train_gpt2 --config configs/gpt2_tiny.json --env_type hivemind --run_id newcomer "
      "--target_batch_size 16 --max_steps 1 --listen " + busy.address() + " --train_files " + train +
      " --save_dir " + tmp.str("ckpt"));
  polytrain::testing::expect_one_line_error(
      r, "hivemind.listen " + busy.address() + ": address in use; choose another port with --listen (another "
         "process holds TCP port " + std::to_string(busy.port) + ", for averaging streams)");
}

}  // namespace
