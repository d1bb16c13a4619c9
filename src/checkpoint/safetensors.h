// Hugging Face safetensors files: save and load named CPU tensors plus string metadata, in
// the reference layout (github.com/huggingface/safetensors). Mapping names to a model's
// parameters (HF checkpoint import/export) is left to the model code that calls these.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace polytrain {

/// Named tensors, as a state dict. (torch::Tensor is at::Tensor.)
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// Writes `tensors` and `metadata` (the `__metadata__` map; left out when empty) to `path`
/// through atomic_write_file. Tensors may be on any device and non-contiguous; they are
/// copied to contiguous CPU memory. Layout as the reference writer: compact JSON header with
/// `__metadata__` first, tensors ordered by dtype alignment (largest first) then name, header
/// padded with spaces to a multiple of 8. Supported dtypes: F64 F32 F16 BF16 I64 I32 I16 I8
/// U8 BOOL. InputError for a duplicate or reserved name, an unsupported dtype, or a name
/// that is not valid UTF-8.
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

/// Reads every tensor of `path` into new CPU tensors, returned sorted by name; fills
/// `*metadata` when given. Validates the header size (<= 100 MB, inside the file), the JSON,
/// each dtype and shape, that data_offsets tile the data area exactly (contiguous, in order,
/// ending at the end of the file) and that shape * itemsize matches them; any violation is
/// an InputError naming the file and the problem. Dtypes libtorch 1.13 lacks (U16, U32, U64,
/// F8_*) are rejected the same way.
NamedTensors load_safetensors(const std::string& path,
                              std::map<std::string, std::string>* metadata = nullptr);

/// The bytes save_safetensors writes, in memory (`what` names them in errors).
std::string safetensors_bytes(const NamedTensors& tensors,
                              const std::map<std::string, std::string>& metadata = {},
                              const std::string& what = "safetensors data");

/// load_safetensors over bytes in memory, with the same checks; errors name `what`.
NamedTensors parse_safetensors(std::string_view bytes, const std::string& what,
                               std::map<std::string, std::string>* metadata = nullptr);

}  // namespace polytrain
