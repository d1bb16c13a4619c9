// DeepSpeed-runner semantics for the resource pool: hostfile parsing ("HOST slots=N"), the
// --include/--exclude filter ("NAME[:SLOT[,SLOT...]][@NAME...]") and --num_nodes/--num_gpus.
// Pure functions over strings; every bad input throws InputError naming file:line or host.
#pragma once

#include <string>
#include <vector>

namespace polytrain::launcher {

/// One host and the slot ids selected on it (GPU indices, or process slots on a CPU host).
struct HostSlots {
  std::string host;
  std::vector<int> slots;
};
/// Hosts in hostfile order, which is rank order.
using ResourcePool = std::vector<HostSlots>;

/// Parses hostfile text: blank and '#' lines skipped, "HOST slots=N" with N > 0, optional
/// trailing "# comment"; a duplicate host, a malformed line or no host at all is an error
/// naming `source` and the line number.
ResourcePool parse_hostfile(const std::string& text, const std::string& source);
/// Reads and parses a hostfile; a missing or unreadable file is an error naming it.
ResourcePool read_hostfile(const std::string& path);

/// Parses "NAME[:SLOT[,SLOT...]][@NAME...]" into (host, slots) pairs in the order written;
/// a bare NAME gives an empty slot list (meaning "all of them"). `flag` names the option in
/// error messages.
std::vector<HostSlots> parse_filter_spec(const std::string& spec, const std::string& flag);

/// DeepSpeed's parse_resource_filter: include keeps only what is named (slots of a repeated
/// host merge, sorted and deduplicated), exclude removes what is named; unknown hosts and
/// slots are errors, both flags together is an error, hosts left without slots drop out,
/// hostfile order is kept.
ResourcePool filter_resources(const ResourcePool& pool, const std::string& include, const std::string& exclude);

/// --num_nodes N keeps the first N hosts, --num_gpus G keeps slots 0..G-1 of each (values
/// <= 0 mean "not given"); asking for more nodes or slots than the pool has is an error.
ResourcePool limit_resources(const ResourcePool& pool, int num_nodes, int num_gpus);

/// `s` without leading and trailing blanks (space, tab, CR, LF).
std::string trim(const std::string& s);

/// The trimmed lines of `text` with their 1-based numbers, blank and '#' lines skipped:
/// the shape shared by hostfiles and .deepspeed_env files.
std::vector<std::pair<int, std::string>> content_lines(const std::string& text);

/// "h1:0,1@h2:0" (the include syntax, every slot explicit).
std::string encode_pool(const ResourcePool& pool);
ResourcePool decode_pool(const std::string& text);

/// A host name the launcher accepts: 1-253 characters of letters, digits, '-', '_' and '.',
/// no empty label and none longer than 63 (DNS), or an IPv4 address. Control characters,
/// blanks, quotes and shell metacharacters never reach a command line.
bool valid_host_name(const std::string& host);

/// Slot lists as written on command lines: "0-7", "1,3", "0-3,6" (ascending, no repeats).
std::string encode_slots(const std::vector<int>& slots);
std::vector<int> decode_slots(const std::string& text, const std::string& flag);

/// The shape of a pool without its host names, run-length encoded: "COUNTxSLOTS" runs joined
/// by '@' ("10000x0-7" for 10,000 hosts of 8 slots): what a per-node launcher started by pdsh
/// needs to find its own slots and first rank from its node rank. Its size grows with the
/// number of runs, not hosts.
std::string encode_slot_layout(const ResourcePool& pool);

/// Where node `node_rank` of a layout stands.
struct NodeView {
  std::vector<int> slots;
  int rank_offset = 0;  ///< global rank of its first slot
  int world_size = 0;
  int num_nodes = 0;
};
NodeView node_in_layout(const std::string& layout, int node_rank);

}  // namespace polytrain::launcher
