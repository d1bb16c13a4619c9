// SentencePieceTokenizer over libsentencepiece, reached through the libpolytrain_spm module
// (data/sentencepiece_shim.cc says why it is dlopened rather than linked). Compiled without
// torch. Without SentencePiece in the build (POLYTRAIN_WITH_SENTENCEPIECE=0) load() throws.
#include "polytrain/data/sentencepiece_tokenizer.h"

#include <filesystem>

#include "polytrain/common/error.h"
#include "polytrain/data/tokenizer_file.h"

#if POLYTRAIN_WITH_SENTENCEPIECE
#include <dlfcn.h>

#include <mutex>
#include <type_traits>
#include <vector>
#endif

namespace polytrain {

#if POLYTRAIN_WITH_SENTENCEPIECE

namespace {

constexpr const char* kSentinelPrefix = "<extra_id_";

// N of "<extra_id_N>", or -1 when `piece` is not of that form.
int64_t parse_sentinel(const std::string& piece) {
  const std::string prefix = kSentinelPrefix;
  if (piece.size() <= prefix.size() + 1 || piece.compare(0, prefix.size(), prefix) != 0 || piece.back() != '>')
    return -1;
  int64_t n = 0;
  for (size_t i = prefix.size(); i + 1 < piece.size(); ++i) {
    if (piece[i] < '0' || piece[i] > '9' || n > 1000000) return -1;
    n = n * 10 + (piece[i] - '0');
  }
  return n;
}

// The module's entry points (sentencepiece_shim.cc).
struct SpmModule {
  void* (*load)(const char*, std::string*) = nullptr;
  void (*free)(void*) = nullptr;
  void (*info)(void*, int*) = nullptr;
  bool (*encode)(void*, const char*, size_t, std::vector<int>*, std::string*) = nullptr;
  bool (*decode)(void*, const std::vector<int>*, std::string*, std::string*) = nullptr;
  void (*id_to_piece)(void*, int, std::string*) = nullptr;
  int (*piece_to_id)(void*, const char*, size_t) = nullptr;
  std::string error;  ///< why it could not be loaded ("" = loaded)
};

// Loads the module once, from the folder of the library holding this code.
const SpmModule& spm_module() {
  static SpmModule m;
  static std::once_flag once;
  std::call_once(once, [] {
    Dl_info info{};
    std::string path = POLYTRAIN_SPM_MODULE;
    if (dladdr(reinterpret_cast<void*>(&spm_module), &info) != 0 && info.dli_fname != nullptr)
      path = (std::filesystem::path(info.dli_fname).parent_path() / POLYTRAIN_SPM_MODULE).string();
#if defined(__SANITIZE_ADDRESS__)
    // ASan's dlopen interceptor refuses RTLD_DEEPBIND (google/sanitizers#611: a deep-bound
    // library's own malloc/free calls bypass the sanitizer's allocator). SentencePiece pairs its
    // own malloc and free, and what crosses into polytrain is allocated through libstdc++, whose
    // calls are bound to the sanitizer's allocator: a sanitizer build asks glibc's dlopen itself.
    using Dlopen = void* (*)(const char*, int);
    void* libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
    const auto real_dlopen = libc ? reinterpret_cast<Dlopen>(dlsym(libc, "dlopen")) : nullptr;
    void* lib = real_dlopen ? real_dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND) : nullptr;
#else
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
#endif
    if (lib == nullptr) {
      const char* e = dlerror();
      m.error = "cannot load " + path + ": " + (e ? e : "unknown error");
      return;
    }
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (fn == nullptr && m.error.empty()) m.error = path + " lacks " + name;
    };
    sym(m.load, "polytrain_spm_load");
    sym(m.free, "polytrain_spm_free");
    sym(m.info, "polytrain_spm_info");
    sym(m.encode, "polytrain_spm_encode");
    sym(m.decode, "polytrain_spm_decode");
    sym(m.id_to_piece, "polytrain_spm_id_to_piece");
    sym(m.piece_to_id, "polytrain_spm_piece_to_id");
  });
  return m;
}

}  // namespace

struct SentencePieceTokenizer::Impl {
  const SpmModule* mod = nullptr;
  void* handle = nullptr;
  ~Impl() {
    if (handle != nullptr) mod->free(handle);
  }
};

bool SentencePieceTokenizer::available() { return spm_module().error.empty(); }

SentencePieceTokenizer SentencePieceTokenizer::load(const std::string& model_path, int64_t extra_ids,
                                                    bool require_t5_ids) {
  const SpmModule& mod = spm_module();
  PT_INPUT_CHECK(mod.error.empty(), "SentencePiece model '", model_path, "': SentencePiece support is missing (",
                 mod.error, ")");
  std::error_code ec;
  PT_INPUT_CHECK(std::filesystem::is_regular_file(model_path, ec), "SentencePiece model '", model_path,
                 "' does not exist or is not a file");
  using K = TokenizerFileKind;
  // libsentencepiece says only "ParseFromArray failed" of a text file.
  const std::string other = refused_tokenizer_file(model_path, {K::kEmpty, K::kJson, K::kWordPieceVocab, K::kBpeMerges,
                                                                K::kSentencePieceVocab, K::kPlainText});
  PT_INPUT_CHECK(other.empty(), "SentencePiece model '", model_path, "' cannot be loaded: it is ", other,
                 "; train_t5 needs a SentencePiece .model (binary, like t5-small's spiece.model) as --spm_model "
                 "or data.vocab_file");
  PT_INPUT_CHECK(extra_ids >= 0, "SentencePiece: extra_ids must be >= 0, got ", extra_ids);
  auto impl = std::make_shared<Impl>();
  impl->mod = &mod;
  std::string error;
  impl->handle = mod.load(model_path.c_str(), &error);
  PT_INPUT_CHECK(impl->handle != nullptr, "SentencePiece model '", model_path, "' cannot be loaded: ", error);
  int info[4];
  mod.info(impl->handle, info);
  SentencePieceTokenizer tok;
  tok.path_ = model_path;
  tok.sp_size_ = info[0];
  tok.extra_ids_ = extra_ids;
  tok.pad_id_ = info[1];
  tok.eos_id_ = info[2];
  tok.unk_id_ = info[3];
  PT_INPUT_CHECK(!require_t5_ids || (tok.pad_id_ == 0 && tok.eos_id_ == 1 && tok.unk_id_ == 2),
                 "SentencePiece model '", model_path, "': T5 needs pad 0, eos 1, unk 2, got pad ", tok.pad_id_,
                 ", eos ", tok.eos_id_, ", unk ", tok.unk_id_, " (spm_train --pad_id=0 --eos_id=1 --unk_id=2)");
  tok.impl_ = std::move(impl);
  return tok;
}

std::vector<int64_t> SentencePieceTokenizer::encode(const std::string& text, bool add_eos) const {
  std::vector<int> ids;
  std::string error;
  PT_CHECK(impl_->mod->encode(impl_->handle, text.data(), text.size(), &ids, &error),
           "SentencePiece encode failed: ", error);
  std::vector<int64_t> out(ids.begin(), ids.end());
  if (add_eos) {
    PT_INPUT_CHECK(eos_id_ >= 0, "SentencePiece model '", path_, "' has no eos piece");
    out.push_back(eos_id_);
  }
  return out;
}

std::string SentencePieceTokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string out, piece_text, error;
  std::vector<int> run;  // model ids since the last sentinel, decoded together
  auto flush = [&] {
    if (run.empty()) return;
    PT_CHECK(impl_->mod->decode(impl_->handle, &run, &piece_text, &error), "SentencePiece decode failed: ", error);
    out += piece_text;
    run.clear();
  };
  for (int64_t id : ids) {
    PT_INPUT_CHECK(id >= 0 && id < vocab_size(), "token id ", id, " outside the vocabulary [0, ", vocab_size(),
                   ") of '", path_, "'");
    if (is_sentinel(id)) {
      flush();
      out += id_to_piece(id);
    } else {
      run.push_back(static_cast<int>(id));
    }
  }
  flush();
  return out;
}

std::string SentencePieceTokenizer::id_to_piece(int64_t id) const {
  PT_INPUT_CHECK(id >= 0 && id < vocab_size(), "token id ", id, " outside the vocabulary [0, ", vocab_size(),
                 ") of '", path_, "'");
  if (is_sentinel(id)) return kSentinelPrefix + std::to_string(vocab_size() - 1 - id) + ">";
  std::string piece;
  impl_->mod->id_to_piece(impl_->handle, static_cast<int>(id), &piece);
  return piece;
}

int64_t SentencePieceTokenizer::piece_to_id(const std::string& piece) const {
  const int64_t n = parse_sentinel(piece);
  if (n >= 0 && n < extra_ids_) return sentinel_id(n);
  return impl_->mod->piece_to_id(impl_->handle, piece.data(), piece.size());
}

#else  // no SentencePiece in this build

struct SentencePieceTokenizer::Impl {};

bool SentencePieceTokenizer::available() { return false; }

SentencePieceTokenizer SentencePieceTokenizer::load(const std::string& model_path, int64_t, bool) {
  throw InputError(detail::cat("SentencePiece model '", model_path,
                               "': polytrain was built without SentencePiece (install libsentencepiece-dev and "
                               "reconfigure with -DPOLYTRAIN_WITH_SENTENCEPIECE=ON)"));
}
// Unreachable: no tokenizer can be loaded.
std::vector<int64_t> SentencePieceTokenizer::encode(const std::string&, bool) const { return {}; }
std::string SentencePieceTokenizer::decode(const std::vector<int64_t>&) const { return {}; }
std::string SentencePieceTokenizer::id_to_piece(int64_t) const { return {}; }
int64_t SentencePieceTokenizer::piece_to_id(const std::string&) const { return -1; }

#endif

int64_t SentencePieceTokenizer::sentinel_id(int64_t i) const {
  PT_INPUT_CHECK(i >= 0 && i < extra_ids_, "sentinel <extra_id_", i, "> out of range: the vocabulary of '", path_,
                 "' has ", extra_ids_, " extra ids");
  return vocab_size() - 1 - i;
}

}  // namespace polytrain
