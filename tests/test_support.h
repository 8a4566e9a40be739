#pragma once

// Shared by the test suites: the one tensor comparison, the notebooks' inputs, a
// finite-difference gradient check, and the CPU/CUDA test parameter.

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "io/zip_archive.h"

namespace attnkit::testing {

// Tolerances, each with its reason.
// The notebooks print 4 decimals: a printed value is within 0.5e-4 of the exact one; the
// extra 1e-6 covers float32 rounding of the value we compute.
constexpr double kPrinted4Decimals = 0.5e-4 + 1e-6;
// Seed 001 prints numpy float64 values with 8 decimals.
constexpr double kPrinted8Decimals = 0.5e-8 + 1e-12;
// Two float32 computations of the same function in a different order of operations.
constexpr double kFloat32 = 1e-5;
// Two float64 computations of the same function in a different order of operations.
constexpr double kFloat64 = 1e-12;

// The Python of this LibTorch leg (its python3-torch): $ATTNKIT_PYTHON, else Debian's python3
// (1.13 on Debian 12, 2.6 inside the Debian 13 root).
inline std::string leg_python() {
  const char* configured = std::getenv("ATTNKIT_PYTHON");
  return configured ? configured : "/usr/bin/python3";
}

/// Runs `script` (a path) with `arguments` under this leg's Python, stdout and stderr into one
/// file under the test's temporary directory; the exit status and everything it printed.
struct ScriptRun {
  int status;
  std::string output;
};
inline ScriptRun run_leg_python(const std::string& script, const std::string& arguments) {
  const auto log = ::testing::TempDir() + std::filesystem::path(script).stem().string() + ".log";
  const auto command = leg_python() + " " + script + " " + arguments + " >" + log + " 2>&1";
  const int status = std::system(command.c_str());
  std::ifstream in(log);
  return {status,
          command + "\n" +
              std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>())};
}

/// Backends agree with math to float32 1e-5 and float64 1e-10 (outputs and gradients).
inline double agreement(torch::ScalarType dtype) {
  return dtype == torch::kFloat32 ? 1e-5 : 1e-10;
}

/// Compares shape first, then values: passes when |actual - expected| <= atol + rtol*|expected|
/// everywhere; otherwise reports the label, the max difference and the first differing index.
inline ::testing::AssertionResult tensors_close(const std::string& label,
                                                const torch::Tensor& actual_in,
                                                const torch::Tensor& expected_in, double atol,
                                                double rtol = 0.0) {
  if (!actual_in.defined() || !expected_in.defined()) {
    return ::testing::AssertionFailure() << label << ": undefined tensor";
  }
  if (actual_in.sizes() != expected_in.sizes()) {
    return ::testing::AssertionFailure()
           << label << ": shape " << actual_in.sizes() << " != expected " << expected_in.sizes();
  }
  const auto actual = actual_in.detach().to(torch::kCPU, torch::kFloat64);
  const auto expected = expected_in.detach().to(torch::kCPU, torch::kFloat64);
  const auto diff = (actual - expected).abs();
  const auto allowed = atol + rtol * expected.abs();
  // NaN compares false, so a NaN anywhere counts as a difference.
  const auto bad = diff.le(allowed).logical_not();
  if (!bad.any().item<bool>()) {
    return ::testing::AssertionSuccess();
  }
  const auto first = bad.flatten().nonzero()[0].item<int64_t>();
  std::vector<int64_t> index(actual.dim());
  for (int64_t d = actual.dim() - 1, rest = first; d >= 0; --d) {
    index[d] = rest % actual.size(d);
    rest /= actual.size(d);
  }
  const auto max_diff = diff.nan_to_num(std::numeric_limits<double>::infinity()).max();
  std::ostringstream where;
  where << torch::IntArrayRef(index);
  return ::testing::AssertionFailure()
         << label << ": max difference " << max_diff.item<double>() << " > tolerance " << atol
         << " (rtol " << rtol << "); first at index " << where.str() << ": actual "
         << actual.flatten()[first].item<double>() << ", expected "
         << expected.flatten()[first].item<double>();
}

#define EXPECT_TENSOR_NEAR(actual, expected, atol) \
  EXPECT_TRUE(::attnkit::testing::tensors_close(#actual, (actual), (expected), (atol)))

/// A tensor (float32 unless told) from nested rows, for values copied from the notebooks.
inline torch::Tensor rows(std::initializer_list<std::initializer_list<double>> values,
                          torch::ScalarType dtype = torch::kFloat32) {
  std::vector<torch::Tensor> out;
  for (const auto& row : values) {
    out.push_back(torch::tensor(std::vector<double>(row), dtype));
  }
  return torch::stack(out);
}

inline torch::Tensor vec(std::initializer_list<double> values) {
  return torch::tensor(std::vector<double>(values), torch::kFloat32);
}

/// "Your journey starts with one step": the notebooks' 6 x 3 embeddings.
inline torch::Tensor journey_inputs() {
  return rows({{0.43, 0.15, 0.89},
               {0.55, 0.87, 0.66},
               {0.57, 0.85, 0.64},
               {0.22, 0.58, 0.33},
               {0.77, 0.25, 0.10},
               {0.05, 0.80, 0.55}});
}

/// The book's batch of two copies: (2, 6, 3).
inline torch::Tensor journey_batch() {
  return torch::stack({journey_inputs(), journey_inputs()});
}

/// A function of (q, k, v), the form the kernels and backends are compared in.
using AttentionFn =
    std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>;

/// Output and gradients of q, k, v of sum(attention(q, k, v) * probe), on clones of the inputs.
inline std::vector<torch::Tensor> output_and_grads(const AttentionFn& attention,
                                                   const torch::Tensor& q_in,
                                                   const torch::Tensor& k_in,
                                                   const torch::Tensor& v_in,
                                                   const torch::Tensor& probe) {
  auto q = q_in.clone().requires_grad_(true);
  auto k = k_in.clone().requires_grad_(true);
  auto v = v_in.clone().requires_grad_(true);
  const auto out = attention(q, k, v);
  (out * probe).sum().backward();
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

/// Expects `message_part` inside the c10::Error thrown by `fn`.
inline void expect_error_containing(const std::function<void()>& fn,
                                    const std::string& message_part) {
  try {
    fn();
    ADD_FAILURE() << "expected a c10::Error containing \"" << message_part << "\", got none";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find(message_part), std::string::npos)
        << "message \"" << message << "\" lacks \"" << message_part << "\"";
  }
}

/// Finite-difference gradient check (float64): for loss = sum(forward(x) * probe) compares
/// autograd's gradient with central differences for the input and every parameter.
inline void expect_gradients_match_finite_differences(
    torch::nn::Module& module, const std::function<torch::Tensor(const torch::Tensor&)>& forward,
    torch::Tensor x) {
  constexpr double kStep = 1e-6;
  // Central differences have O(step^2) truncation and O(eps/step) rounding error: ~1e-9 here.
  constexpr double kTolerance = 1e-6;
  x = x.to(torch::kFloat64).detach().requires_grad_(true);
  const auto probe = torch::randn_like(forward(x)).detach();
  const auto loss_of = [&]() { return (forward(x) * probe).sum(); };

  module.zero_grad();
  loss_of().backward();

  std::vector<std::pair<std::string, torch::Tensor>> tensors{{"input", x}};
  for (const auto& item : module.named_parameters()) {
    tensors.emplace_back(item.key(), item.value());
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, tensor] : tensors) {
    ASSERT_TRUE(tensor.grad().defined()) << name << " got no gradient";
    auto flat = tensor.view({-1});
    auto numeric = torch::zeros_like(flat);
    for (int64_t i = 0; i < flat.numel(); ++i) {
      const double original = flat[i].item<double>();
      flat[i].fill_(original + kStep);
      const double plus = loss_of().item<double>();
      flat[i].fill_(original - kStep);
      const double minus = loss_of().item<double>();
      flat[i].fill_(original);
      numeric[i] = (plus - minus) / (2 * kStep);
    }
    EXPECT_TRUE(tensors_close("grad of " + name, tensor.grad().view({-1}), numeric, kTolerance));
  }
}

/// A fresh temporary directory per test, removed afterwards.
// Flips one byte (all of its bits) at each of `positions` of every record of the file at
// `path`, and expects `load` to refuse each damaged copy with an error naming the record.
inline void expect_every_flip_reported(const std::string& path, const std::string& copy,
                                       const std::function<void(const std::string&)>& load,
                                       size_t max_positions_per_record) {
  std::ifstream in(path, std::ios::binary);
  const std::string good{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  const auto records = attnkit::detail::zip_records(good, path);
  ASSERT_GE(records.size(), 3u);
  size_t flips = 0;
  for (const auto& record : records) {
    const uint64_t step = std::max<uint64_t>(1, record.size / max_positions_per_record);
    for (uint64_t at = 0; at < record.size; at += step) {
      std::string damaged = good;
      damaged[record.offset + at] = static_cast<char>(damaged[record.offset + at] ^ 0xFF);
      std::ofstream(copy, std::ios::binary | std::ios::trunc) << damaged;
      SCOPED_TRACE(record.name + " byte " + std::to_string(at));
      expect_error_containing([&] { load(copy); },
                              "record '" + record.name + "' does not match its CRC-32");
      ++flips;
    }
  }
  EXPECT_GT(flips, records.size());
}

class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::temp_directory_path() /
           ("attnkit_" + std::string(info->test_suite_name()) + "_" + info->name() + "_" +
            std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  std::filesystem::path dir_;
};

/// Parameter for suites that run on every device; CUDA cases skip without a GPU.
class DeviceTest : public ::testing::TestWithParam<torch::DeviceType> {
 protected:
  void SetUp() override {
    if (GetParam() == torch::kCUDA && !torch::cuda::is_available()) {
      GTEST_SKIP() << "CUDA not available (torch::cuda::is_available() is false): "
                      "CUDA variant skipped";
    }
  }
  torch::Device device() const { return torch::Device(GetParam()); }
};

inline std::string device_test_name(const ::testing::TestParamInfo<torch::DeviceType>& info) {
  return info.param == torch::kCUDA ? "CUDA" : "CPU";
}

#define ATTNKIT_INSTANTIATE_DEVICE_TESTS(suite)                                          \
  INSTANTIATE_TEST_SUITE_P(Devices, suite, ::testing::Values(torch::kCPU, torch::kCUDA), \
                           ::attnkit::testing::device_test_name)

}  // namespace attnkit::testing
