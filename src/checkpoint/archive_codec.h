// Checkpoint files and hivemind peer states as safetensors, not TorchScript archives.
//
// The trainer, the optimizers and the backends fill libtorch archives (OutputArchive), and
// read InputArchives, as libtorch's own optimizers do. libtorch 1.13 stores an archive as a
// TorchScript module: reading one compiles the Python-like source inside it, and a file
// edited by hand (or a state sent by a hostile peer) crashes that compiler (fuzz_checkpoint,
// fuzz/known_crashes). So an archive never goes to or comes from disk or the network as
// TorchScript: encode_archive turns it into safetensors (its tensors by number; the tree of
// keys, nested archives, ints, doubles, bools, strings and string lists as JSON in the
// `polytrain.archive` metadata entry), and decode_archive validates such bytes (the
// safetensors reader's checks, then the tree's schema) and rebuilds the archive from the
// parsed values. libtorch only ever loads archives polytrain wrote itself, in memory.
#pragma once

#include <string>
#include <string_view>

namespace torch::serialize {
class InputArchive;
class OutputArchive;
}  // namespace torch::serialize

namespace polytrain {

/// The metadata key holding the archive's tree, and the tree's format version.
inline constexpr const char* kArchiveTreeKey = "polytrain.archive";
inline constexpr int kArchiveTreeVersion = 1;

/// `archive` as safetensors bytes. InternalError if it holds a value the format does not
/// (anything but tensors, nested archives, int, double, bool, string, list of strings).
std::string encode_archive(torch::serialize::OutputArchive& archive);

/// Fills `out` with the archive `bytes` hold; an InputError naming `origin` for anything that
/// is not what encode_archive writes (bad safetensors, no or malformed tree, a key that is not
/// an identifier, a tensor named twice or not at all, nesting deeper than 16).
void decode_archive(std::string_view bytes, const std::string& origin, torch::serialize::InputArchive& out);

/// decode_archive's checks without building the InputArchive (no libtorch serialisation):
/// for bytes that are kept, not read (the monitor's copy of a donor's state).
void check_archive(std::string_view bytes, const std::string& origin);

}  // namespace polytrain
