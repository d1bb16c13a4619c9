#include "polytrain/launcher/mpi_world.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <memory>

#if POLYTRAIN_WITH_PMIX
#include <pmix.h>
#include <pmix_server.h>
#endif

namespace polytrain::launcher {

#if POLYTRAIN_WITH_PMIX
namespace {

// One server per process (PMIx allows one); started on first use, ended at exit. Its files
// (the clients' rendezvous and shared key-value store) live in a private temporary folder.
struct Server {
  bool up = false;
  std::string error;
  std::string tmpdir;

  Server() {
    std::error_code ec;
    const auto base = std::filesystem::temp_directory_path(ec);  // $TMPDIR, else /tmp
    std::string tmpl = (ec ? std::filesystem::path("/tmp") : base).string() + "/polytrain-pmix-XXXXXX";
    if (!mkdtemp(tmpl.data())) {
      error = "cannot create " + tmpl + ": " + std::strerror(errno);
      return;
    }
    tmpdir = tmpl;
    pmix_info_t info[2];
    PMIX_INFO_LOAD(&info[0], PMIX_SERVER_TMPDIR, tmpdir.c_str(), PMIX_STRING);
    PMIX_INFO_LOAD(&info[1], PMIX_SYSTEM_TMPDIR, tmpdir.c_str(), PMIX_STRING);
    const pmix_status_t rc = PMIx_server_init(nullptr, info, 2);
    PMIX_INFO_DESTRUCT(&info[0]);
    PMIX_INFO_DESTRUCT(&info[1]);
    if (rc != PMIX_SUCCESS) {
      error = std::string("PMIx_server_init: ") + PMIx_Error_string(rc);
      std::filesystem::remove_all(tmpdir);
      return;
    }
    up = true;
  }
  ~Server() {
    if (up) PMIx_server_finalize();
    std::error_code ec;
    if (!tmpdir.empty()) std::filesystem::remove_all(tmpdir, ec);
  }
};

Server& server() {
  static Server s;
  return s;
}

using OpPromise = std::shared_ptr<std::promise<pmix_status_t>>;

void op_done(pmix_status_t status, void* cbdata) {
  auto* keep = static_cast<OpPromise*>(cbdata);
  (*keep)->set_value(status);
  delete keep;
}

// Runs a PMIx call that reports through an op callback and waits for it (bounded: the server's
// own thread answers these locally). The promise is shared with the callback, which may still
// come after a timeout.
template <typename Call>
pmix_status_t wait_op(Call call) {
  auto done = std::make_shared<std::promise<pmix_status_t>>();
  auto f = done->get_future();
  auto* keep = new OpPromise(done);
  const pmix_status_t rc = call(&op_done, keep);
  if (rc != PMIX_SUCCESS) {  // the callback will not be called
    delete keep;
    return rc == PMIX_OPERATION_SUCCEEDED ? PMIX_SUCCESS : rc;
  }
  if (f.wait_for(std::chrono::seconds(10)) != std::future_status::ready) return PMIX_ERR_TIMEOUT;
  return f.get();
}

void load_u32(pmix_info_t& i, const char* key, uint32_t v) { PMIX_INFO_LOAD(&i, key, &v, PMIX_UINT32); }

}  // namespace

bool mpi_world_supported() { return true; }

std::unique_ptr<LocalMpiWorld> LocalMpiWorld::create(int nprocs, int attempt, std::string& why) {
  Server& s = server();
  if (!s.up) {
    why = s.error;
    return nullptr;
  }
  std::unique_ptr<LocalMpiWorld> w(new LocalMpiWorld());
  w->nspace_ = "polytrain-" + std::to_string(getpid()) + "-" + std::to_string(attempt);
  // Where Open MPI keeps this job's files: a rank that is killed never removes its own, and
  // this launcher is not mpirun's daemon, which would. Shared-memory segments stay on tmpfs.
  EnvList job_env;
  auto job_dir = [&](const std::string& var, const std::filesystem::path& base) {
    std::error_code ec;
    if (std::getenv(var.c_str()) || !std::filesystem::is_directory(base, ec)) return;  // the user's value wins
    const auto dir = base / w->nspace_;
    if (!std::filesystem::create_directory(dir, ec) || ec) return;
    w->job_dirs_.push_back(dir.string());
    job_env.emplace_back(var, dir.string());
  };
  job_dir("OMPI_MCA_btl_vader_backing_directory", "/dev/shm");
  job_dir("OMPI_MCA_orte_tmpdir_base", s.tmpdir);
  pmix_nspace_t ns;
  PMIX_LOAD_NSPACE(ns, w->nspace_.c_str());

  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) != 0 || !host[0]) std::strcpy(host, "localhost");
  std::string peers;
  for (int r = 0; r < nprocs; ++r) peers += (r ? "," : "") + std::to_string(r);
  char *node_map = nullptr, *proc_map = nullptr;
  PMIx_generate_regex(host, &node_map);
  PMIx_generate_ppn(peers.c_str(), &proc_map);

  // Job-level facts (one node, every rank on it) and each rank's own, as a resource manager
  // gives them; Open MPI reads the local ranks and peers from here to set up shared memory.
  const size_t njob = 11;
  pmix_info_t* info;
  PMIX_INFO_CREATE(info, njob + static_cast<size_t>(nprocs));
  load_u32(info[0], PMIX_UNIV_SIZE, nprocs);
  load_u32(info[1], PMIX_JOB_SIZE, nprocs);
  load_u32(info[2], PMIX_LOCAL_SIZE, nprocs);
  load_u32(info[3], PMIX_MAX_PROCS, nprocs);
  load_u32(info[4], PMIX_NUM_NODES, 1);
  load_u32(info[5], PMIX_APPNUM, 0);
  load_u32(info[6], PMIX_NODEID, 0);
  PMIX_INFO_LOAD(&info[7], PMIX_LOCAL_PEERS, peers.c_str(), PMIX_STRING);
  PMIX_INFO_LOAD(&info[8], PMIX_NODE_MAP, node_map, PMIX_STRING);
  PMIX_INFO_LOAD(&info[9], PMIX_PROC_MAP, proc_map, PMIX_STRING);
  PMIX_INFO_LOAD(&info[10], PMIX_JOBID, w->nspace_.c_str(), PMIX_STRING);
  std::free(node_map);
  std::free(proc_map);
  for (int r = 0; r < nprocs; ++r) {
    pmix_data_array_t* da;
    PMIX_DATA_ARRAY_CREATE(da, 5, PMIX_INFO);
    auto* pi = static_cast<pmix_info_t*>(da->array);
    const pmix_rank_t rank = static_cast<pmix_rank_t>(r);
    const uint16_t local = static_cast<uint16_t>(r);
    PMIX_INFO_LOAD(&pi[0], PMIX_RANK, &rank, PMIX_PROC_RANK);
    PMIX_INFO_LOAD(&pi[1], PMIX_LOCAL_RANK, &local, PMIX_UINT16);
    PMIX_INFO_LOAD(&pi[2], PMIX_NODE_RANK, &local, PMIX_UINT16);
    PMIX_INFO_LOAD(&pi[3], PMIX_HOSTNAME, host, PMIX_STRING);
    load_u32(pi[4], PMIX_NODEID, 0);
    PMIX_INFO_LOAD(&info[njob + static_cast<size_t>(r)], PMIX_PROC_DATA, da, PMIX_DATA_ARRAY);
    PMIX_DATA_ARRAY_FREE(da);
  }
  const pmix_status_t rc = wait_op([&](pmix_op_cbfunc_t cb, void* cbdata) {
    return PMIx_server_register_nspace(ns, nprocs, info, njob + static_cast<size_t>(nprocs), cb, cbdata);
  });
  PMIX_INFO_FREE(info, njob + static_cast<size_t>(nprocs));
  if (rc != PMIX_SUCCESS) {
    why = std::string("PMIx_server_register_nspace: ") + PMIx_Error_string(rc);
    return nullptr;
  }
  for (int r = 0; r < nprocs; ++r) {
    pmix_proc_t proc;
    PMIX_PROC_LOAD(&proc, ns, static_cast<pmix_rank_t>(r));
    pmix_status_t c = wait_op([&](pmix_op_cbfunc_t cb, void* cbdata) {
      return PMIx_server_register_client(&proc, getuid(), getgid(), nullptr, cb, cbdata);
    });
    char** env = nullptr;
    if (c == PMIX_SUCCESS) c = PMIx_server_setup_fork(&proc, &env);
    if (c != PMIX_SUCCESS) {
      why = std::string("PMIx client ") + std::to_string(r) + ": " + PMIx_Error_string(c);
      return nullptr;  // the destructor ends the job registered so far
    }
    EnvList e;
    for (char** p = env; p && *p; ++p) {
      const char* eq = std::strchr(*p, '=');
      if (eq) e.emplace_back(std::string(*p, static_cast<size_t>(eq - *p)), std::string(eq + 1));
      std::free(*p);
    }
    std::free(env);
    // Open MPI 4 takes a process for directly launched only under a resource manager it knows
    // (its "schizo" components); Flux's is the one that asks for nothing else and leaves the
    // binding alone. Open MPI 5 and MPICH need only the PMIX_* variables above.
    e.emplace_back("FLUX_JOB_ID", w->nspace_);
    e.emplace_back("POLYTRAIN_MPI_WORLD", "pmix");
    e.insert(e.end(), job_env.begin(), job_env.end());
    w->env_.push_back(std::move(e));
  }
  return w;
}

LocalMpiWorld::~LocalMpiWorld() {
  pmix_nspace_t ns;
  PMIX_LOAD_NSPACE(ns, nspace_.c_str());
  wait_op([&](pmix_op_cbfunc_t cb, void* cbdata) {
    PMIx_server_deregister_nspace(ns, cb, cbdata);
    return PMIX_SUCCESS;
  });
  for (const auto& d : job_dirs_) {  // the job's ranks have all ended (the supervisor reaped them)
    std::error_code ec;
    std::filesystem::remove_all(d, ec);
  }
}

#else

bool mpi_world_supported() { return false; }

std::unique_ptr<LocalMpiWorld> LocalMpiWorld::create(int, int, std::string& why) {
  why = "this launcher was built without PMIx (libpmix-dev)";
  return nullptr;
}

LocalMpiWorld::~LocalMpiWorld() = default;

#endif

}  // namespace polytrain::launcher
