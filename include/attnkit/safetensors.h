#pragma once

/// Hugging Face's safetensors files, read and written in C++, and checkpoints from elsewhere
/// loaded into attnkit's modules through a name map (docs/models.md).
///
/// The format: an 8-byte little-endian header length N, N bytes of JSON that give each
/// tensor's dtype, shape and byte range, then the tensors' raw little-endian bytes. Reading
/// checks the whole header before it touches a weight: the file's size, the JSON, each dtype,
/// each shape against its byte count, and that the byte ranges cover the data exactly once (no
/// overlap, no hole, nothing past the end). A damaged or hostile file is a `c10::Error` that
/// names the file and says what is wrong, never a crash or a huge allocation.
///
/// The file is memory-mapped: a tensor whose bytes are aligned for its dtype (all of them in
/// files that the `safetensors` package or attnkit writes) is a view of the mapping, not a
/// copy. The mapping is private (copy-on-write), so writing to a loaded tensor never changes
/// the file; it lives as long as a tensor that views it. As with any memory-mapped file, a
/// file that another process truncates while its tensors live makes reading them fail.

#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "attnkit/serialize.h"

namespace attnkit {

/// The `__metadata__` of a safetensors file: string keys to string values
/// (`{"format": "pt"}` in files from PyTorch).
using SafetensorsMetadata = std::map<std::string, std::string>;

/// Reads every tensor of a safetensors file, in the header's order, on the CPU.
/// Dtypes: F64, F32, F16, BF16, I64, I32, I16, I8, U8 and BOOL; another is an error naming it.
/// Example: `auto weights = attnkit::load_safetensors("model.safetensors");`
StateDict load_safetensors(const std::string& path);

/// The file's `__metadata__` (empty when it has none), after the same checks as
/// `load_safetensors`.
/// Example: `attnkit::load_safetensors_metadata("model.safetensors").at("format")`
SafetensorsMetadata load_safetensors_metadata(const std::string& path);

/// Writes `dict` as a safetensors file that the `safetensors` package reads
/// (`safetensors.torch.load_file`). Tensors are copied to the CPU; the header lists them in
/// the dict's order, and their bytes are laid out widest dtype first, so that every tensor is
/// aligned for its dtype. Written to a temporary name, flushed and renamed, as
/// `write_state_dict` does: `path` never holds a partial file.
/// Example: `attnkit::save_safetensors(attnkit::state_dict(*mha), "mha.safetensors");`
void save_safetensors(const StateDict& dict, const std::string& path,
                      const SafetensorsMetadata& metadata = {});

/// One rule of a `NameMap`: a checkpoint name that matches `pattern` (an ECMAScript regular
/// expression over the whole name) becomes `targets` (which may use `$1`, `$2`, ... for the
/// pattern's groups).
struct NameRule {
  std::string pattern;
  /// One target renames. Several split the tensor along dimension 0 into that many parts, in
  /// order: equal ones (GPT-2's fused `c_attn` into query, key and value), or `split_sizes`.
  std::vector<std::string> targets;
  /// Transposes a 2-d weight before any split (GPT-2's `Conv1D` stores (in, out), where
  /// `torch::nn::Linear` holds (out, in)).
  bool transpose = false;
  /// With several targets: each part's size along dimension 0, in order, summing to it
  /// (Phi-3's fused `qkv_proj`: the query heads, then the narrower key and value heads).
  /// Empty: equal parts.
  std::vector<int64_t> split_sizes = {};
};

/// How one architecture's checkpoint names become the names of an attnkit-based model. It is
/// data, written once per architecture (docs/models.md). A name first loses `prefix` when it
/// starts with it; then it is dropped if it matches a pattern of `ignored`; else the first
/// rule that matches it maps it; a name that no rule matches keeps its name.
struct NameMap {
  std::string prefix;
  /// Checkpoint entries the model does not hold (BERT's `position_ids` buffer, GPT-2's causal
  /// `attn.bias`): whole-name regular expressions.
  std::vector<std::string> ignored;
  std::vector<NameRule> rules;

  /// The checkpoint `dict` under the model's names. Two entries mapping to one name, a split
  /// of a tensor whose first dimension the parts do not divide, and a transpose of a tensor
  /// that is not 2-d are errors naming the entry.
  StateDict apply(const StateDict& dict) const;
};

/// Loads a safetensors checkpoint into `module` through `names`: `load_state_dict`'s checks
/// and its strictness (every parameter and buffer of the module present, no entry left over,
/// every shape equal), all before a weight changes. Errors name the file.
/// Example: `attnkit::load_safetensors(*encoder, "model.safetensors", bert_names);`
LoadResult load_safetensors(torch::nn::Module& module, const std::string& path,
                            const NameMap& names = {}, bool strict = true);

}  // namespace attnkit
