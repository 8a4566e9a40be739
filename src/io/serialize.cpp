#include "attnkit/serialize.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include "attnkit/python_state.h"
#include "core/base/checks.h"
#include "io/file_io.h"
#include "io/state_dict_reader.h"

namespace attnkit {

using detail::shape_string;

namespace {

std::string and_more(size_t count) {
  return count > 1 ? c10::str(" and ", count - 1, " more") : std::string();
}

// The whole file: a state dict is read in one piece, and never more than the file's size is
// allocated before its records have been checked.
std::string read_bytes(const std::string& path) {
  detail::check_not_directory("[read_state_dict]", path);
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "[read_state_dict] cannot open '", path, "' for reading");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TORCH_CHECK(!in.bad(), "[read_state_dict] error while reading '", path, "'");
  TORCH_CHECK(!bytes.empty(), "[read_state_dict] '", path,
              "' is empty; expected a dict of tensors saved by attnkit::save_state_dict or by "
              "Python's torch.save(model.state_dict(), path)");
  return bytes;
}

// torch.save's format for a dict of tensors: a zip archive with the pickled dict in data.pkl
// and each tensor's storage in data/<index>. LibTorch's own torch::pickle_save wraps every dict
// in a `torch.jit._pickle.restore_type_tag` call, a global that PyTorch >= 2.6's default
// weights-only torch.load refuses; the pickle written here names only what torch.save itself
// names (torch._utils._rebuild_tensor_v2, torch.<Type>Storage, collections.OrderedDict).
std::vector<char> torch_save_bytes(const StateDict& dict) {
  c10::Dict<std::string, torch::Tensor> tensors;
  for (const auto& item : dict) {
    // Python reads CPU tensors on any machine. A view (a parameter inside a flat buffer)
    // is copied, so that only its own elements are stored and not the whole storage.
    auto tensor = item.value().detach().to(torch::kCPU).contiguous();
    if (tensor.storage_offset() != 0 ||
        tensor.storage().nbytes() != static_cast<size_t>(tensor.numel() * tensor.element_size())) {
      tensor = tensor.clone();
    }
    tensors.insert(item.key(), tensor);
  }
  std::vector<char> pickle;
  torch::jit::Pickler pickler(
      [&](const char* data, size_t size) { pickle.insert(pickle.end(), data, data + size); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(c10::IValue(tensors));
  pickler.stop();

  std::vector<char> bytes;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) {
    const auto* begin = static_cast<const char*>(data);
    bytes.insert(bytes.end(), begin, begin + size);
    return size;
  });
  const auto& storages = pickler.tensorData();  // in the order of the pickle's storage keys
  for (size_t index = 0; index < storages.size(); ++index) {
    const auto storage = torch::jit::getWriteableTensorData(storages[index]);
    writer.writeRecord("data/" + std::to_string(index), storage.data(), storage.sizeInBytes());
  }
  writer.writeRecord("data.pkl", pickle.data(), pickle.size());
  writer.writeEndOfFile();
  return bytes;
}

// Calls `visit(prefix, holder)` for the module and each submodule that keeps Python-only
// state: prefix "" for the module itself, "<submodule path>." for the others.
template <typename Visit>
void for_each_python_only_state(const torch::nn::Module& module, Visit visit) {
  const auto visit_one = [&](const std::string& prefix, const torch::nn::Module& m) {
    if (const auto* holder = dynamic_cast<const PythonOnlyState*>(&m))
      visit(prefix, *holder);
  };
  visit_one("", module);
  // include_self = false: the root may not be owned by a shared_ptr.
  for (const auto& child : module.named_modules("", /*include_self=*/false))
    visit_one(child.key() + ".", *child.value());
}

}  // namespace

StateDict state_dict(const torch::nn::Module& module) {
  StateDict dict;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    dict.insert(item.key(), item.value().detach());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    dict.insert(item.key(), item.value().detach());
  }
  for_each_python_only_state(module, [&](const std::string& prefix, const PythonOnlyState& holder) {
    for (const auto& [key, value] : holder.python_only_state())
      dict.insert(prefix + key, value.detach());
  });
  return dict;
}

void write_state_dict(const StateDict& dict, const std::string& path) {
  const std::vector<char> bytes = torch_save_bytes(dict);
  write_atomically(path, "[write_state_dict]", [&](std::ostream& out) {
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  });
}

StateDict read_state_dict(const std::string& path) {
  return detail::parse_state_dict(read_bytes(path), path);
}

void save_state_dict(const torch::nn::Module& module, const std::string& path) {
  write_state_dict(state_dict(module), path);
}

namespace {

// The keys a load accepts and ignores: the Python-only state of the module and its submodules.
std::vector<std::string> python_only_keys(const torch::nn::Module& module) {
  std::vector<std::string> keys;
  for_each_python_only_state(module, [&](const std::string& prefix, const PythonOnlyState& holder) {
    for (const auto& key : holder.python_only_keys())
      keys.push_back(prefix + key);
  });
  return keys;
}

}  // namespace

namespace detail {

std::string write_destination(const std::string& path) {
  namespace fs = std::filesystem;
  std::string current = path;
  for (int links = 0; links < 40; ++links) {  // Linux's own limit on a chain of links
    std::error_code error;
    if (!fs::is_symlink(fs::symlink_status(current, error)) || error)
      return current;
    fs::path target = fs::read_symlink(current, error);
    if (error)
      return current;
    current = (target.is_relative() ? fs::path(current).parent_path() / target : target).string();
  }
  TORCH_CHECK(false, "'", path, "': more than 40 symbolic links in a row (a loop?)");
  return path;
}

std::string temporary_path(const std::string& path) {
  return write_destination(path) + "." + std::to_string(::getpid()) + ".tmp";
}

}  // namespace detail

void write_atomically(const std::string& path, const char* who,
                      const std::function<void(std::ostream&)>& write) {
  namespace fs = std::filesystem;
  const std::string destination = detail::write_destination(path);
  std::error_code error;
  const auto status = fs::status(destination, error);
  TORCH_CHECK(!fs::is_directory(status), who, " '", path, "' is a directory; expected a file");
  if (fs::exists(status) && !fs::is_regular_file(status)) {
    std::ofstream out(destination, std::ios::binary);
    TORCH_CHECK(out.good(), who, " cannot open '", path, "' for writing");
    write(out);
    out.flush();
    TORCH_CHECK(out.good(), who, " writing '", path, "' failed");
    return;
  }
  const std::string temporary = detail::temporary_path(path);
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(out.good(), who, " cannot open '", temporary, "' for writing");
    write(out);
    out.flush();
    if (!out.good()) {
      out.close();
      std::remove(temporary.c_str());
      TORCH_CHECK(false, who, " writing '", temporary, "' failed (disk full?)");
    }
  }
  // On disk before the rename, so that a crash leaves the old file or the whole new one.
  const int descriptor = ::open(temporary.c_str(), O_RDONLY | O_CLOEXEC);
  if (descriptor >= 0) {
    ::fsync(descriptor);
    ::close(descriptor);
  }
  if (std::rename(temporary.c_str(), destination.c_str()) != 0) {
    std::remove(temporary.c_str());
    TORCH_CHECK(false, who, " cannot rename '", temporary, "' to '", destination, "'");
  }
}

namespace detail {

LoadResult load_into(torch::nn::Module& module, const StateDict& dict, bool strict,
                     const std::string& source) {
  auto targets = module.named_parameters(/*recurse=*/true);
  for (const auto& buffer : module.named_buffers(/*recurse=*/true)) {
    targets.insert(buffer.key(), buffer.value());
  }
  const auto ignorable = python_only_keys(module);
  // Check everything first: a failed load must not leave a half-loaded module.
  LoadResult result;
  for (const auto& target : targets) {
    const auto* source_tensor = dict.find(target.key());
    if (source_tensor == nullptr) {
      result.missing_keys.push_back(target.key());
      continue;
    }
    TORCH_CHECK(source_tensor->sizes() == target.value().sizes(), "[load_state_dict] ", source,
                ": key '", target.key(), "' has shape ", shape_string(*source_tensor),
                ", the module expects ", shape_string(target.value()));
  }
  for (const auto& item : dict) {
    if (targets.find(item.key()) != nullptr)
      continue;
    const bool ignored =
        std::find(ignorable.begin(), ignorable.end(), item.key()) != ignorable.end();
    (ignored ? result.ignored_keys : result.unexpected_keys).push_back(item.key());
  }
  if (strict) {
    if (!result.missing_keys.empty()) {
      const auto& key = result.missing_keys.front();
      TORCH_CHECK(false, "[load_state_dict] ", source, ": missing key '", key, "' (shape ",
                  shape_string(targets[key]), ")", and_more(result.missing_keys.size()),
                  "; pass strict = false to load the rest");
    }
    if (!result.unexpected_keys.empty()) {
      const auto& key = result.unexpected_keys.front();
      TORCH_CHECK(false, "[load_state_dict] ", source, ": unexpected key '", key, "' (shape ",
                  shape_string(dict[key]), ")", and_more(result.unexpected_keys.size()),
                  "; the module has no such parameter or buffer; pass strict = false to ignore");
    }
  }
  torch::NoGradGuard no_grad;
  for (auto& target : targets) {
    if (const auto* source_tensor = dict.find(target.key())) {
      target.value().copy_(*source_tensor);  // converts dtype and device as Python does
    }
  }
  return result;
}

}  // namespace detail

LoadResult load_state_dict(torch::nn::Module& module, const StateDict& dict, bool strict) {
  return detail::load_into(module, dict, strict, "state dict");
}

LoadResult load_state_dict(torch::nn::Module& module, const std::string& path, bool strict) {
  return detail::load_into(module, read_state_dict(path), strict, "'" + path + "'");
}

}  // namespace attnkit
