#include "attnkit/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <regex>
#include <set>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/base/checks.h"
#include "io/file_io.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors.cpp reads and writes the format's little-endian bytes as they are in memory"
#endif

namespace attnkit {

using detail::shape_string;
using Json = nlohmann::ordered_json;  // keeps the header's order

namespace {

// The format's own limit on the JSON header (the safetensors package refuses more).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DtypeName {
  const char* name;
  torch::Dtype dtype;
};
// Every dtype that LibTorch 1.13 has and the format names (U16/U32/U64 and the 8-bit floats
// have no tensor type there).
constexpr DtypeName kDtypes[] = {{"F64", torch::kFloat64}, {"F32", torch::kFloat32},
                                 {"F16", torch::kFloat16}, {"BF16", torch::kBFloat16},
                                 {"I64", torch::kInt64},   {"I32", torch::kInt32},
                                 {"I16", torch::kInt16},   {"I8", torch::kInt8},
                                 {"U8", torch::kUInt8},    {"BOOL", torch::kBool}};

std::string dtype_names() {
  std::string names;
  for (const auto& entry : kDtypes)
    names += (names.empty() ? "" : ", ") + std::string(entry.name);
  return names;
}

// A read-only file's bytes, mapped privately: writes to a tensor that views them stay in this
// process. Unmapped when the last tensor viewing it goes.
class Mapping {
 public:
  Mapping(const std::string& path, const char* who) {
    detail::check_not_directory(who, path);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    TORCH_CHECK(fd >= 0, who, " cannot open '", path, "' for reading: ", std::strerror(errno));
    struct stat info {};
    if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
      ::close(fd);
      TORCH_CHECK(false, who, " '", path, "' is not a regular file");
    }
    size_ = static_cast<uint64_t>(info.st_size);
    if (size_ > 0) {
      data_ = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    }
    const int map_error = errno;
    ::close(fd);
    TORCH_CHECK(data_ != MAP_FAILED, who, " cannot map '", path,
                "' into memory: ", std::strerror(map_error));
  }
  ~Mapping() {
    if (data_ != nullptr && data_ != MAP_FAILED)
      ::munmap(data_, size_);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  const uint8_t* bytes() const { return static_cast<const uint8_t*>(data_); }
  uint8_t* mutable_bytes() { return static_cast<uint8_t*>(data_); }
  uint64_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  uint64_t size_ = 0;
};

struct Entry {
  std::string name;
  torch::Dtype dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // within the data, after the header
  uint64_t end = 0;
};

struct Header {
  std::vector<Entry> entries;  // in the header's order
  SafetensorsMetadata metadata;
  uint64_t data_offset = 0;  // of the data in the file: 8 + the header's length
};

uint64_t read_u64_le(const uint8_t* bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i)
    value = (value << 8) | bytes[i];
  return value;
}

uint64_t as_count(const Json& value, const std::string& what, const std::string& where) {
  TORCH_CHECK(value.is_number_unsigned(), where, ": ", what,
              " must be a non-negative integer, got ", value.dump());
  return value.get<uint64_t>();
}

Entry parse_entry(const std::string& name, const Json& json, const std::string& where) {
  TORCH_CHECK(json.is_object(), where,
              ": expected an object with dtype, shape and data_offsets, "
              "got ",
              json.dump());
  for (const auto& field : json.items()) {
    const auto& key = field.key();
    TORCH_CHECK(key == "dtype" || key == "shape" || key == "data_offsets", where,
                ": unknown field '", key, "' (expected dtype, shape and data_offsets)");
  }
  TORCH_CHECK(json.contains("dtype") && json.contains("shape") && json.contains("data_offsets"),
              where, ": expected dtype, shape and data_offsets, got ", json.dump());
  Entry entry;
  entry.name = name;
  const auto& dtype = json["dtype"];
  TORCH_CHECK(dtype.is_string(), where, ": dtype must be a string, got ", dtype.dump());
  const auto known = std::find_if(std::begin(kDtypes), std::end(kDtypes),
                                  [&](const DtypeName& d) { return dtype == d.name; });
  TORCH_CHECK(known != std::end(kDtypes), where, ": unsupported dtype ", dtype.dump(),
              " (attnkit reads ", dtype_names(), ")");
  entry.dtype = known->dtype;

  const auto& shape = json["shape"];
  TORCH_CHECK(shape.is_array(), where, ": shape must be an array, got ", shape.dump());
  // The element count, with every product checked: no shape may claim more than the file holds.
  uint64_t numel = 1;
  bool overflow = false;
  for (const auto& dim : shape) {
    const uint64_t size = as_count(dim, "each dimension of shape", where);
    TORCH_CHECK(size <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), where,
                ": dimension ", size, " is too large");
    entry.shape.push_back(static_cast<int64_t>(size));
    if (size != 0 && numel > std::numeric_limits<uint64_t>::max() / size)
      overflow = true;
    numel *= size;
  }
  const auto& offsets = json["data_offsets"];
  TORCH_CHECK(offsets.is_array() && offsets.size() == 2, where,
              ": data_offsets must be [begin, end], got ", offsets.dump());
  entry.begin = as_count(offsets[0], "data_offsets", where);
  entry.end = as_count(offsets[1], "data_offsets", where);
  TORCH_CHECK(entry.begin <= entry.end, where, ": data_offsets [", entry.begin, ", ", entry.end,
              "] end before they begin");
  const uint64_t item_size = c10::elementSize(entry.dtype);
  const bool sizes_agree = !overflow && numel <= std::numeric_limits<uint64_t>::max() / item_size &&
                           numel * item_size == entry.end - entry.begin;
  TORCH_CHECK(sizes_agree, where, ": shape ", shape.dump(), " of ", dtype.get<std::string>(),
              " needs ", overflow ? std::string("more than 2^64") : std::to_string(numel),
              " elements of ", item_size, " bytes, but data_offsets [", entry.begin, ", ",
              entry.end, "] hold ", entry.end - entry.begin, " bytes");
  return entry;
}

// Every check of the format, on the mapped file, before any tensor is made.
Header parse_header(const Mapping& file, const std::string& path, const char* who) {
  const std::string where = c10::str(who, " '", path, "'");
  TORCH_CHECK(file.size() >= 8, where, " is truncated: ", file.size(),
              " bytes, fewer than the 8 of a safetensors header length");
  const uint64_t header_bytes = read_u64_le(file.bytes());
  TORCH_CHECK(header_bytes <= kMaxHeaderBytes, where, ": the header length ", header_bytes,
              " is absurd (at most ", kMaxHeaderBytes, " bytes); not a safetensors file?");
  TORCH_CHECK(header_bytes <= file.size() - 8, where, " is truncated: its header needs ",
              header_bytes, " bytes after the first 8, the file has ", file.size() - 8);
  Header header;
  header.data_offset = 8 + header_bytes;

  // The JSON, with each top-level name seen once (nlohmann's objects would keep only one).
  const auto* text = reinterpret_cast<const char*>(file.bytes() + 8);
  std::set<std::string> names;
  std::string duplicate;
  const Json::parser_callback_t unique_names = [&](int depth, Json::parse_event_t event,
                                                   Json& parsed) {
    if (depth == 1 && event == Json::parse_event_t::key && parsed.is_string() &&
        !names.insert(parsed.get<std::string>()).second && duplicate.empty()) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  Json json;
  try {
    json = Json::parse(text, text + header_bytes, unique_names);
  } catch (const Json::exception& error) {
    TORCH_CHECK(false, where, ": the header is not valid JSON (", error.what(), ")");
  }
  TORCH_CHECK(duplicate.empty(), where, ": the header names '", duplicate, "' twice");
  TORCH_CHECK(json.is_object(), where, ": the header must be a JSON object, got a ",
              json.type_name());

  for (const auto& item : json.items()) {
    const auto& name = item.key();
    if (name == "__metadata__") {
      TORCH_CHECK(item.value().is_object(), where, ": __metadata__ must be an object, got ",
                  item.value().dump());
      for (const auto& field : item.value().items()) {
        TORCH_CHECK(field.value().is_string(), where, ": __metadata__ value '", field.key(),
                    "' must be a string, got ", field.value().dump());
        header.metadata.emplace(field.key(), field.value().get<std::string>());
      }
      continue;
    }
    header.entries.push_back(
        parse_entry(name, item.value(), c10::str(where, ": tensor '", name, "'")));
  }

  // The byte ranges cover the data exactly once, as the format requires: no overlap (two
  // tensors sharing bytes), no hole (bytes no tensor owns), nothing past the end.
  const uint64_t data_bytes = file.size() - header.data_offset;
  std::vector<const Entry*> by_offset;
  for (const auto& entry : header.entries)
    by_offset.push_back(&entry);
  std::sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) {
    return std::tie(a->begin, a->end) < std::tie(b->begin, b->end);
  });
  uint64_t covered = 0;
  const Entry* previous = nullptr;
  for (const Entry* entry : by_offset) {
    TORCH_CHECK(entry->begin >= covered, where, ": tensor '", entry->name, "' (data_offsets [",
                entry->begin, ", ", entry->end, "]) overlaps tensor '", previous->name,
                "' (data_offsets [", previous->begin, ", ", previous->end, "])");
    TORCH_CHECK(entry->begin == covered, where, ": bytes [", covered, ", ", entry->begin,
                ") of the data belong to no tensor (before tensor '", entry->name, "')");
    TORCH_CHECK(entry->end <= data_bytes, where, " is truncated: tensor '", entry->name,
                "' ends at byte ", entry->end, " of the data, which holds ", data_bytes);
    covered = entry->end;
    previous = entry;
  }
  TORCH_CHECK(covered == data_bytes, where, ": the last ", data_bytes - covered,
              " bytes of the file belong to no tensor");
  return header;
}

torch::Tensor tensor_of(const Entry& entry, const std::shared_ptr<Mapping>& file,
                        uint64_t data_offset, const std::string& where) {
  uint8_t* bytes = file->mutable_bytes() + data_offset + entry.begin;
  const auto options = torch::TensorOptions().dtype(entry.dtype);
  if (entry.dtype == torch::kBool) {
    // A bool other than 0 or 1 is not a value any tensor can hold.
    for (uint64_t i = 0; i < entry.end - entry.begin; ++i) {
      TORCH_CHECK(bytes[i] <= 1, where, ": tensor '", entry.name, "' holds ",
                  static_cast<int>(bytes[i]), " at element ", i, ", which is not a BOOL (0 or 1)");
    }
  }
  const uint64_t item_size = c10::elementSize(entry.dtype);
  if (entry.begin == entry.end)
    return torch::empty(entry.shape, options);
  if (reinterpret_cast<uintptr_t>(bytes) % item_size != 0) {
    // Misaligned for its dtype (the format does not require alignment): copied out.
    auto tensor = torch::empty(entry.shape, options);
    std::memcpy(tensor.data_ptr(), bytes, entry.end - entry.begin);
    return tensor;
  }
  // A view of the mapping, which the tensor keeps alive.
  return torch::from_blob(
      bytes, entry.shape, [keep = file](void*) mutable { keep.reset(); }, options);
}

}  // namespace

StateDict load_safetensors(const std::string& path) {
  constexpr const char* kWho = "[load_safetensors]";
  auto file = std::make_shared<Mapping>(path, kWho);
  const Header header = parse_header(*file, path, kWho);
  const std::string where = c10::str(kWho, " '", path, "'");
  StateDict dict;
  for (const auto& entry : header.entries)
    dict.insert(entry.name, tensor_of(entry, file, header.data_offset, where));
  return dict;
}

SafetensorsMetadata load_safetensors_metadata(const std::string& path) {
  constexpr const char* kWho = "[load_safetensors_metadata]";
  const Mapping file(path, kWho);
  return parse_header(file, path, kWho).metadata;
}

void save_safetensors(const StateDict& dict, const std::string& path,
                      const SafetensorsMetadata& metadata) {
  constexpr const char* kWho = "[save_safetensors]";
  struct Saved {
    const std::string* name;
    const char* dtype;
    torch::Tensor tensor;  // contiguous, on the CPU
    uint64_t begin = 0;
  };
  std::vector<Saved> saved;
  for (const auto& item : dict) {
    TORCH_CHECK(item.key() != "__metadata__", kWho,
                " '__metadata__' is the format's own entry, not a tensor name; pass it as "
                "`metadata`");
    const auto dtype = item.value().scalar_type();
    const auto known = std::find_if(std::begin(kDtypes), std::end(kDtypes),
                                    [&](const DtypeName& d) { return d.dtype == dtype; });
    TORCH_CHECK(known != std::end(kDtypes), kWho, " tensor '", item.key(), "' has dtype ", dtype,
                "; safetensors files hold ", dtype_names());
    saved.push_back(
        {&item.key(), known->name, item.value().detach().to(torch::kCPU).contiguous(), 0});
  }
  // Widest dtype first: with the data starting on a multiple of 8, every tensor is aligned.
  std::vector<Saved*> layout;
  for (auto& item : saved)
    layout.push_back(&item);
  std::stable_sort(layout.begin(), layout.end(), [](const Saved* a, const Saved* b) {
    return a->tensor.element_size() > b->tensor.element_size();
  });
  uint64_t offset = 0;
  for (Saved* item : layout) {
    item->begin = offset;
    offset += static_cast<uint64_t>(item->tensor.numel()) * item->tensor.element_size();
  }

  Json header = Json::object();
  if (!metadata.empty()) {
    Json fields = Json::object();
    for (const auto& [key, value] : metadata)
      fields[key] = value;
    header["__metadata__"] = fields;
  }
  for (const auto& item : saved) {
    const uint64_t bytes = static_cast<uint64_t>(item.tensor.numel()) * item.tensor.element_size();
    header[*item.name] = {{"dtype", item.dtype},
                          {"shape", item.tensor.sizes().vec()},
                          {"data_offsets", {item.begin, item.begin + bytes}}};
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const Json::exception& error) {
    TORCH_CHECK(false, kWho, " '", path, "': a name or metadata string is not UTF-8 (",
                error.what(), ")");
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts on a multiple of 8
  write_atomically(path, kWho, [&](std::ostream& out) {
    uint8_t length[8];
    for (int i = 0; i < 8; ++i)
      length[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
    out.write(reinterpret_cast<const char*>(length), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const Saved* item : layout) {
      out.write(static_cast<const char*>(item->tensor.data_ptr()),
                static_cast<std::streamsize>(item->tensor.numel() * item->tensor.element_size()));
    }
  });
}

StateDict NameMap::apply(const StateDict& dict) const {
  std::vector<std::regex> ignored_patterns;
  for (const auto& pattern : ignored)
    ignored_patterns.emplace_back(pattern);
  std::vector<std::regex> rule_patterns;
  for (const auto& rule : rules) {
    TORCH_CHECK(!rule.targets.empty(), "[NameMap::apply] the rule for '", rule.pattern,
                "' has no target");
    rule_patterns.emplace_back(rule.pattern);
  }
  StateDict mapped;
  const auto add = [&](const std::string& source, const std::string& target,
                       const torch::Tensor& tensor) {
    TORCH_CHECK(mapped.find(target) == nullptr, "[NameMap::apply] '", source, "' maps to '", target,
                "', which another entry already maps to");
    mapped.insert(target, tensor);
  };
  for (const auto& item : dict) {
    std::string name = item.key();
    if (!prefix.empty() && name.compare(0, prefix.size(), prefix) == 0)
      name.erase(0, prefix.size());
    std::smatch match;
    const auto matches = [&](const std::regex& pattern) {
      return std::regex_match(name, match, pattern);
    };
    if (std::any_of(ignored_patterns.begin(), ignored_patterns.end(), matches))
      continue;
    const auto rule = std::find_if(rule_patterns.begin(), rule_patterns.end(), matches);
    if (rule == rule_patterns.end()) {
      add(item.key(), name, item.value());
      continue;
    }
    const NameRule& spec = rules[rule - rule_patterns.begin()];
    torch::Tensor tensor = item.value();
    if (spec.transpose) {
      TORCH_CHECK(tensor.dim() == 2, "[NameMap::apply] '", item.key(), "': the rule for '",
                  spec.pattern, "' transposes, so expected a 2-d tensor, got shape ",
                  shape_string(tensor));
      tensor = tensor.t();
    }
    const auto parts = static_cast<int64_t>(spec.targets.size());
    std::vector<torch::Tensor> pieces{tensor};
    if (!spec.split_sizes.empty()) {
      TORCH_CHECK(static_cast<int64_t>(spec.split_sizes.size()) == parts, "[NameMap::apply] '",
                  item.key(), "': the rule for '", spec.pattern, "' has ", parts,
                  " targets but split_sizes ", c10::IntArrayRef(spec.split_sizes));
      const auto total =
          std::accumulate(spec.split_sizes.begin(), spec.split_sizes.end(), int64_t{0});
      const bool positive = std::all_of(spec.split_sizes.begin(), spec.split_sizes.end(),
                                        [](int64_t size) { return size > 0; });
      TORCH_CHECK(positive && tensor.dim() >= 1 && tensor.size(0) == total, "[NameMap::apply] '",
                  item.key(), "': the rule for '", spec.pattern, "' splits it into parts of ",
                  c10::IntArrayRef(spec.split_sizes), " along dimension 0, which needs ", total,
                  " rows of positive parts, got shape ", shape_string(tensor));
      pieces = tensor.split_with_sizes(spec.split_sizes, 0);
    } else if (parts > 1) {
      TORCH_CHECK(tensor.dim() >= 1 && tensor.size(0) % parts == 0, "[NameMap::apply] '",
                  item.key(), "': the rule for '", spec.pattern, "' splits it into ", parts,
                  " parts along dimension 0, which shape ", shape_string(tensor),
                  " does not divide");
      pieces = tensor.chunk(parts, 0);
    }
    for (int64_t i = 0; i < parts; ++i)
      add(item.key(), match.format(spec.targets[i]), pieces[i]);
  }
  return mapped;
}

LoadResult load_safetensors(torch::nn::Module& module, const std::string& path,
                            const NameMap& names, bool strict) {
  return detail::load_into(module, names.apply(load_safetensors(path)), strict, "'" + path + "'");
}

}  // namespace attnkit
