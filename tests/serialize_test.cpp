// attnkit/serialize.h: state dicts across C++ and Python, and every way a file can be bad.

#include "attnkit/serialize.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>

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
