// `hivemind_monitor --run_id NAME --listen HOST:PORT [--initial_peers ...]`: the swarm's
// monitor peer (run_training_monitor.py of hivemind's collaborative ALBERT recipe), with no
// model. Its DHT node welcomes peers (they pass its address as --initial_peers); it reads the
// trainer peers' `metrics` records and logs, for each global step, the swarm's loss (weighted
// by samples), alive peers, samples and samples/s to <log_dir>/metrics.jsonl, TensorBoard and
// the console; with --save_every N it loads the swarm's state from its donors every N global
// steps (several donors at once, checksummed, as a newcomer does) and saves it as a checkpoint
// that any training program resumes with --load_dir. Runs until SIGINT/SIGTERM (or
// --max_steps); a second signal ends it at once (a checkpoint being written is then not
// committed: the previous ones stay intact).
#include <CLI/CLI.hpp>

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "polytrain/common/cli_config.h"
#include "polytrain/common/error.h"
#include "polytrain/common/main_guard.h"
#include "polytrain/swarm/dht.h"
#include "polytrain/swarm/metrics.h"
#include "polytrain/swarm/progress.h"
#include "polytrain/swarm/record.h"
#include "polytrain/swarm/state.h"
#include "polytrain/checkpoint/archive_codec.h"
#include "polytrain/checkpoint/checkpoint.h"
#include "polytrain/trainer/tensorboard.h"

namespace {

using namespace polytrain;
namespace hm = polytrain::hivemind;
namespace fs = std::filesystem;
using std::chrono::milliseconds;

std::atomic<int> g_signal{0};

void on_signal(int sig) {
  if (g_signal.exchange(sig) != 0) _exit(128 + sig);  // the second one: now
}

milliseconds ms(double seconds) { return milliseconds(static_cast<int64_t>(seconds * 1000.0)); }

struct Options {
  std::string run_id, listen = "0.0.0.0:0", identity, log_dir, save_dir;
  std::vector<std::string> initial_peers;
  int64_t save_every = 0, keep_last = 2, max_steps = 0;
  double refresh = 1.0, bootstrap_timeout = 10.0, load_state_timeout = 600.0, request_timeout = 3.0,
         next_chunk_timeout = 10.0;
};

class Monitor {
 public:
  explicit Monitor(const Options& o) : o_(o), swarm_(std::max(1.0, 2 * o.refresh), std::max(10.0, 4 * o.refresh)) {
    fs::create_directories(o_.log_dir);
    const std::string jsonl = (fs::path(o_.log_dir) / "metrics.jsonl").string();
    jsonl_ = std::fopen(jsonl.c_str(), "a");
    PT_INPUT_CHECK(jsonl_, "--log_dir: cannot write ", jsonl);
    tb_ = std::make_unique<TensorBoardWriter>(o_.log_dir);
    auto identity = std::make_shared<const hm::Identity>(o_.identity.empty() ? hm::Identity::generate()
                                                                             : hm::Identity::load_or_create(o_.identity));
    hm::DhtOptions d;
    d.run_id = o_.run_id;
    d.listen = o_.listen;
    d.initial_peers = o_.initial_peers;
    d.bootstrap_timeout = ms(o_.bootstrap_timeout);
    dht_ = std::make_unique<hm::DhtNode>(d, identity);
    if (o_.save_every > 0) next_save_ = o_.save_every;
    std::printf("hivemind_monitor: run '%s', DHT on %s (UDP); peers join with --initial_peers %s; logging to %s%s%s\n",
                o_.run_id.c_str(), dht_->address().c_str(), dht_->address().c_str(), jsonl.c_str(),
                o_.save_every > 0 ? "; checkpoints in " : "", o_.save_every > 0 ? o_.save_dir.c_str() : "");
    std::fflush(stdout);
  }

  ~Monitor() {
    if (saver_.joinable()) saver_.join();
    if (jsonl_) std::fclose(jsonl_);
  }

  /// Polls until a signal (or max_steps); returns the exit code.
  int run() {
    const auto period = ms(o_.refresh);
    while (g_signal.load() == 0) {
      const auto next = std::chrono::steady_clock::now() + period;
      poll();
      if (o_.max_steps > 0 && swarm_.last_final() >= o_.max_steps) break;
      while (g_signal.load() == 0 && std::chrono::steady_clock::now() < next)
        std::this_thread::sleep_for(milliseconds(10));
    }
    log(swarm_.take_final(hm::unix_seconds(), /*flush=*/true));
    tb_->flush();
    if (saver_.joinable()) {
      if (saving_) std::printf("hivemind_monitor: finishing the checkpoint under way\n");
      std::fflush(stdout);
      saver_.join();
    }
    const int sig = g_signal.load();
    std::printf("hivemind_monitor: %s after %lld logged global step(s), %zu checkpoint(s) saved%s\n",
                sig ? (std::string("stopped by signal ") + std::to_string(sig)).c_str() : "done",
                static_cast<long long>(logged_), saved_.size(),
                dht_->rejected().total() ? ("; refused records: " + dht_->rejected().summary()).c_str() : "");
    std::fflush(stdout);
    return 0;
  }

 private:
  void poll() {
    const double now = hm::unix_seconds();
    int64_t newest = -1;
    for (const auto& r : dht_->fetch(o_.run_id + "_metrics", milliseconds(1000))) {
      if (r.kind != "metrics") continue;
      if (auto recent = hm::decode_metrics(r.payload))
        for (const auto& m : *recent) {  // a peer's last steps: those a slower poll missed too
          swarm_.add(hm::to_hex(r.owner), m, now);
          newest = std::max(newest, m.step);
        }
    }
    log(swarm_.take_final(now));
    // The download runs beside the polls (a step's records are read while it loads).
    if (next_save_ > 0 && newest >= next_save_ && !saving_ && g_signal.load() == 0) {
      if (saver_.joinable()) saver_.join();
      saving_ = true;
      saver_ = std::thread([this, newest] {
        try {
          save(newest);
        } catch (const std::exception& e) {
          // A checkpoint folder that cannot be written: said, and tried again at the next step.
          std::fprintf(stderr, "hivemind_monitor: step %lld: checkpoint not saved: %s\n", static_cast<long long>(newest),
                       e.what());
        }
        saving_ = false;
      });
    }
  }

  void log(const std::vector<hm::SwarmStep>& steps) {
    for (const auto& s : steps) {
      const nlohmann::json j = {{"step", s.step},
                                {"loss", s.loss},
                                {"alive_peers", s.alive_peers},
                                {"samples", s.samples},
                                {"samples_per_second", s.samples_per_second},
                                {"mini_steps", s.mini_steps},
                                {"time", hm::unix_seconds()}};
      std::fprintf(jsonl_, "%s\n", j.dump().c_str());
      std::fflush(jsonl_);
      tb_->add_scalar("swarm/loss", s.loss, s.step);
      tb_->add_scalar("swarm/alive_peers", static_cast<double>(s.alive_peers), s.step);
      tb_->add_scalar("swarm/samples", static_cast<double>(s.samples), s.step);
      tb_->add_scalar("swarm/samples_per_second", s.samples_per_second, s.step);
      tb_->flush();
      std::printf("step %lld | loss %.4f | peers %lld | samples %lld | %.1f samples/s\n", static_cast<long long>(s.step),
                  s.loss, static_cast<long long>(s.alive_peers), static_cast<long long>(s.samples), s.samples_per_second);
      std::fflush(stdout);
      ++logged_;
    }
  }

  // The swarm's state at step `step` or later, from its donors, as a checkpoint.
  void save(int64_t step) {
    hm::DownloadOptions d;
    d.timeout = ms(o_.load_state_timeout);
    d.request_timeout = ms(o_.request_timeout);
    d.next_chunk_timeout = ms(o_.next_chunk_timeout);
    d.min_epoch = step;
    hm::DownloadReport rep;
    const auto snap = hm::load_state_from_peers(*dht_, o_.run_id + "_state", d, &rep);
    for (const auto& f : rep.donors_failed) std::fprintf(stderr, "hivemind_monitor: state donor %s\n", f.c_str());
    if (!snap) {
      // Tried again at the next step seen.
      std::fprintf(stderr, "hivemind_monitor: step %lld: could not load the swarm's state: %s\n",
                   static_cast<long long>(step), rep.why_none.c_str());
      return;
    }
    const auto s = hm::unpack_peer_state(snap->bytes);
    if (!s) {
      std::fprintf(stderr, "hivemind_monitor: step %lld: the donors' state is not a polytrain peer state; not saved\n",
                   static_cast<long long>(step));
      next_save_ = step + o_.save_every;
      return;
    }
    try {
      // What a resume will read, checked now: a donor's bytes are not written as a checkpoint
      // unless they pass every check a resume's decode makes (archive_codec.h).
      check_archive(s->model, "the donors' model state");
      check_archive(s->optimizer, "the donors' optimizer state");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "hivemind_monitor: step %lld: %s; not saved\n", static_cast<long long>(step), e.what());
      next_save_ = step + o_.save_every;
      return;
    }
    const std::string tag = "global_step" + std::to_string(s->epoch);
    nlohmann::json config = nlohmann::json::parse(s->config, nullptr, /*allow_exceptions=*/false);
    if (config.is_discarded()) config = nullptr;
    CheckpointWriter w(o_.save_dir, tag, CheckpointGroup{});
    w.write_file("state.pt", s->model);
    w.write_file(ShardReader::file_name(0), s->optimizer);
    {
      // A resumed program draws its random numbers from here and starts its stream over.
      torch::serialize::OutputArchive own;
      auto rng = at::detail::getDefaultCPUGenerator();
      own.write("cpu_rng_state", rng.get_state());
      own.write("stream_cursor", torch::tensor({int64_t{0}}, torch::kLong));
      w.write_archive("rank_0.pt", own);
    }
    const nlohmann::json meta = {{"step", s->epoch},
                                 {"applied_steps", s->epoch},
                                 {"skipped_steps", 0},
                                 {"loss_scaler", nullptr},
                                 {"best_eval_loss", nullptr},
                                 {"world_size", 1},
                                 {"dp_size", 1},
                                 {"grid", {{"world", 1}, {"tp", 1}, {"dp", 1}, {"pp", 1}}},
                                 {"env_type", "hivemind"},
                                 {"saved_by", "hivemind_monitor"},
                                 {"donors", rep.donors_used},
                                 {"config", config}};
    w.commit(meta, /*set_latest=*/true);
    saved_.push_back(tag);
    while (o_.keep_last > 0 && static_cast<int64_t>(saved_.size()) > o_.keep_last) {
      remove_checkpoint(o_.save_dir, saved_.front());
      saved_.erase(saved_.begin());
    }
    std::printf("hivemind_monitor: saved the swarm's state at step %lld to %s/%s (%.1f MB from %zu donor(s) in %.2f s)\n",
                static_cast<long long>(s->epoch), o_.save_dir.c_str(), tag.c_str(), static_cast<double>(rep.bytes) / 1e6,
                rep.donors_used.size(), rep.seconds);
    std::fflush(stdout);
    next_save_ = (s->epoch / o_.save_every + 1) * o_.save_every;
  }

  Options o_;
  hm::SwarmMetrics swarm_;
  std::unique_ptr<hm::DhtNode> dht_;
  std::FILE* jsonl_ = nullptr;
  std::unique_ptr<TensorBoardWriter> tb_;
  std::atomic<int64_t> next_save_{0};
  int64_t logged_ = 0;
  std::atomic<bool> saving_{false};
  std::thread saver_;
  std::vector<std::string> saved_;
};

int monitor_main(int argc, char** argv) {
  CLI::App app{"The monitor peer of a hivemind swarm: logs the swarm's metrics and saves its state"};
  Options o;
  std::string peers;
  app.add_option("--run_id", o.run_id, "the swarm's run id (as its peers' hivemind.run_id)")->required();
  app.add_option("--listen", o.listen, "HOST:PORT of this node's DHT socket (UDP); port 0: any")->capture_default_str();
  app.add_option("--initial_peers", peers, "HOST:PORT[,HOST:PORT...] of nodes already in the swarm");
  app.add_option("--identity", o.identity, "Ed25519 key file (created when missing; default: a new key)");
  app.add_option("--log_dir", o.log_dir, "metrics.jsonl and TensorBoard events (default: monitor_<run_id>)");
  app.add_option("--save_dir", o.save_dir, "checkpoint folder (with --save_every)");
  app.add_option("--save_every", o.save_every, "save the swarm's state every N global steps (0: never)")->capture_default_str();
  app.add_option("--keep_last", o.keep_last, "checkpoints kept (0: all)")->capture_default_str();
  app.add_option("--max_steps", o.max_steps, "stop after logging this global step (0: run until a signal)")->capture_default_str();
  app.add_option("--refresh", o.refresh, "seconds between reads of the swarm's records")->capture_default_str();
  app.add_option("--bootstrap_timeout", o.bootstrap_timeout, "seconds to reach an initial peer")->capture_default_str();
  app.add_option("--load_state_timeout", o.load_state_timeout, "seconds for one whole state download")->capture_default_str();
  app.add_option("--request_timeout", o.request_timeout, "seconds to connect to a donor")->capture_default_str();
  app.add_option("--next_chunk_timeout", o.next_chunk_timeout, "seconds for each next chunk from a donor")->capture_default_str();
  if (!parse_cli(app, argc, argv)) return 0;  // --help
  PT_INPUT_CHECK(!o.run_id.empty(), "--run_id: empty");
  std::stringstream ss(peers);
  for (std::string p; std::getline(ss, p, ',');)
    if (!p.empty()) o.initial_peers.push_back(p);
  PT_INPUT_CHECK(o.refresh >= 0.05 && o.refresh <= 3600, "--refresh: ", o.refresh, " s (0.05 to 3600)");
  PT_INPUT_CHECK(o.save_every >= 0, "--save_every: ", o.save_every, " (>= 0)");
  PT_INPUT_CHECK(o.save_every == 0 || !o.save_dir.empty(), "--save_every ", o.save_every, " needs --save_dir");
  PT_INPUT_CHECK(o.keep_last >= 0, "--keep_last: ", o.keep_last, " (>= 0)");
  PT_INPUT_CHECK(o.max_steps >= 0, "--max_steps: ", o.max_steps, " (>= 0)");
  for (double v : {o.bootstrap_timeout, o.load_state_timeout, o.request_timeout, o.next_chunk_timeout})
    PT_INPUT_CHECK(v > 0 && std::isfinite(v), "timeouts must be > 0 seconds (got ", v, ")");
  if (o.log_dir.empty()) o.log_dir = "monitor_" + o.run_id;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  Monitor m(o);
  return m.run();
}

}  // namespace

int main(int argc, char** argv) {
  return polytrain::run_main([&] { return monitor_main(argc, argv); });
}
