// Golden parity: every case of data/golden/ and data/golden/family/ (written by
// scripts/make_golden.py from the Python reference classes) must give the same output and
// gradients in C++.

#include <algorithm>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "attnkit/serialize.h"
#include "module_factory.h"
#include "source_paths.h"
#include "test_support.h"

using namespace attnkit::testing;

namespace {

// Bump together with FORMAT_VERSION in scripts/make_golden.py.
constexpr int64_t kGoldenFormatVersion = 1;
constexpr const char* kRegenerate = "regenerate with: python3 scripts/make_golden.py";

// C++ and Python call the same LibTorch kernels, so results agree to rounding of a few
// ulps; 1e-6 (absolute, plus relative for values above 1) in float32 and 1e-12 in float64
// leave room for that and nothing else.
constexpr double kGoldenFloat32 = 1e-6;
constexpr double kGoldenFloat64 = 1e-12;

std::string golden_dir() {
  return std::string(kSourceDir) + "/data/golden";
}

// Case paths below data/golden/ from the MANIFEST of each golden directory; a missing
// manifest yields one case that fails with the hint, rather than silently testing nothing.
std::vector<std::string> golden_cases() {
  std::vector<std::string> paths;
  for (const std::string directory : {"", "family/"}) {
    std::ifstream manifest(golden_dir() + "/" + directory + "MANIFEST");
    if (!manifest) {
      paths.push_back(directory + "MANIFEST_missing");
      continue;
    }
    for (std::string line; std::getline(manifest, line);) {
      if (!line.empty() && line[0] != '#') {
        paths.push_back(directory + line);
      }
    }
  }
  return paths;
}

c10::IValue at(const c10::IValue& dict, const std::string& key, const std::string& file) {
  const auto generic = dict.toGenericDict();
  const auto found = generic.find(key);
  TORCH_CHECK(found != generic.end(), "golden file ", file, " lacks '", key, "'; ", kRegenerate);
  return found->value();
}

c10::IValue read_case(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  TORCH_CHECK(in.good(), "golden file ", file, " is missing; ", kRegenerate);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                std::istreambuf_iterator<char>());
  return torch::pickle_load(bytes);
}

class GoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenTest, OutputAndEveryGradientMatchPython) {
  const auto name = GetParam();
  ASSERT_EQ(name.find("MANIFEST_missing"), std::string::npos)
      << golden_dir() << "/" << name << ": the manifest is missing; " << kRegenerate;
  const auto file = golden_dir() + "/" + name + ".pt";
  const auto golden = read_case(file);
  const auto meta = at(golden, "meta", file);
  ASSERT_EQ(at(meta, "format_version", file).toInt(), kGoldenFormatVersion)
      << file << " is stale (format version); " << kRegenerate;

  const auto module_name = at(meta, "module", file).toStringRef();
  const auto dtype_name = at(meta, "dtype", file).toStringRef();
  ASSERT_TRUE(dtype_name == "float32" || dtype_name == "float64") << dtype_name;
  const auto dtype = dtype_name == "float32" ? torch::kFloat32 : torch::kFloat64;
  const double atol = dtype == torch::kFloat32 ? kGoldenFloat32 : kGoldenFloat64;

  auto attention = make_attention(module_name, module_config_of(at(meta, "config", file)));
  attention.module->to(dtype);
  attention.module->eval();
  // The state dict file is exactly what Python's torch.save(dict(model.state_dict())) wrote.
  attnkit::load_state_dict(*attention.module, golden_dir() + "/" + name + ".state.pt");

  const auto x = at(golden, "input", file).toTensor().clone().requires_grad_(true);
  const auto output = attention.forward(x);
  const auto expected_output = at(golden, "output", file).toTensor();
  EXPECT_TRUE(tensors_close(name + " output", output, expected_output, atol, /*rtol=*/atol));
  double max_diff = (output - expected_output).abs().max().item<double>();
  (output * at(golden, "loss_weights", file).toTensor()).sum().backward();

  const auto grads = at(golden, "grads", file).toGenericDict();
  const auto parameters = attention.module->named_parameters();
  EXPECT_EQ(grads.size(), parameters.size() + 1) << "one gradient per parameter, plus the input";
  for (const auto& entry : grads) {
    const auto& key = entry.key().toStringRef();
    const auto expected = entry.value().toTensor();
    const auto actual = key == "input" ? x.grad() : parameters[key].grad();
    EXPECT_TRUE(tensors_close(name + " grad " + key, actual, expected, atol, /*rtol=*/atol));
    if (actual.defined() && actual.sizes() == expected.sizes()) {
      max_diff = std::max(max_diff, (actual - expected).abs().max().item<double>());
    }
  }
  std::cout << "[golden] " << name << ": output and " << grads.size()
            << " gradients, max difference " << max_diff << "\n";
}

INSTANTIATE_TEST_SUITE_P(Python, GoldenTest, ::testing::ValuesIn(golden_cases()),
                         [](const ::testing::TestParamInfo<std::string>& case_info) {
                           auto name = case_info.param;  // family/200_X -> family_200_X
                           std::replace(name.begin(), name.end(), '/', '_');
                           return name;
                         });

}  // namespace
