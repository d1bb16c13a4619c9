// libpolytrain_spm: the only code linked against libsentencepiece, built as a module that
// data/sentencepiece_tokenizer.cpp dlopens with RTLD_LOCAL | RTLD_DEEPBIND. Why: Debian's
// libsentencepiece exports its bundled protobuf-lite (3.14) under the same names as the
// libprotobuf.so.32 (3.21) that libtorch loads; linked normally, either library's calls land in
// the other's copy and every program crashes at start. Loaded this way, sentencepiece binds to
// its own copy and nothing of it enters the global symbol scope. (.cc: outside the library's
// *.cpp glob on purpose.) The interface is plain C over one process's libstdc++.
#include <sentencepiece_processor.h>

#include <string>
#include <vector>

// Exported by libsentencepiece (common.h) but not declared in its public header.
namespace sentencepiece::logging {
void SetMinLogLevel(int v);
}  // namespace sentencepiece::logging

namespace {

struct Handle {
  sentencepiece::SentencePieceProcessor sp;
};

}  // namespace

extern "C" {

/// Loads a model; nullptr with *error set on failure.
__attribute__((visibility("default"))) void* polytrain_spm_load(const char* path, std::string* error) {
  // Nothing on stderr from the library: its LOG() writes to std::cerr, which under
  // RTLD_DEEPBIND may not be the stream the program initialised.
  sentencepiece::logging::SetMinLogLevel(100);
  auto* h = new Handle;
  const auto status = h->sp.Load(path);
  if (!status.ok()) {
    *error = status.ToString();
    delete h;
    return nullptr;
  }
  return h;
}

__attribute__((visibility("default"))) void polytrain_spm_free(void* handle) { delete static_cast<Handle*>(handle); }

/// size, pad, eos, unk.
__attribute__((visibility("default"))) void polytrain_spm_info(void* handle, int* out) {
  const auto& sp = static_cast<Handle*>(handle)->sp;
  out[0] = sp.GetPieceSize();
  out[1] = sp.pad_id();
  out[2] = sp.eos_id();
  out[3] = sp.unk_id();
}

/// false with *error set on failure.
__attribute__((visibility("default"))) bool polytrain_spm_encode(void* handle, const char* text, size_t size,
                                                                 std::vector<int>* ids, std::string* error) {
  const auto status = static_cast<Handle*>(handle)->sp.Encode(std::string(text, size), ids);
  if (!status.ok()) *error = status.ToString();
  return status.ok();
}

__attribute__((visibility("default"))) bool polytrain_spm_decode(void* handle, const std::vector<int>* ids,
                                                                 std::string* text, std::string* error) {
  const auto status = static_cast<Handle*>(handle)->sp.Decode(*ids, text);
  if (!status.ok()) *error = status.ToString();
  return status.ok();
}

__attribute__((visibility("default"))) void polytrain_spm_id_to_piece(void* handle, int id, std::string* piece) {
  *piece = static_cast<Handle*>(handle)->sp.IdToPiece(id);
}

__attribute__((visibility("default"))) int polytrain_spm_piece_to_id(void* handle, const char* piece, size_t size) {
  return static_cast<Handle*>(handle)->sp.PieceToId(std::string(piece, size));
}

}  // extern "C"
