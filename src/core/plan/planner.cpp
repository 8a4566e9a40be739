// The planner (planner.h): walks a table of kernel specs, the first that takes a call runs
// it; the 16-bit and autocast policy around the walk; the kernel record.

#include "core/plan/planner.h"

#include <optional>

#include "core/base/autocast.h"
#include "core/base/matrix_units.h"

namespace attnkit::detail {

namespace {

namespace F = attnkit::functional;

bool serves(const KernelSpec& spec, AttentionBackend requested) {
  return requested == AttentionBackend::kAuto || spec.backend == AttentionBackend::kAuto ||
         spec.backend == requested;
}

// A kernel that took a call, and its plan.
struct Choice {
  const KernelSpec* spec = nullptr;
  KernelDecision decision;
};

// The kernel's decision with what the planner asks of every kernel: a split forward and
// backward for a split call, sinks for a call with sinks.
KernelDecision decide(const KernelSpec& spec, const KernelInput& input) {
  auto decision = spec.decide(input);
  if (decision.declined.empty() && input.call.split && !decision.split.forward)
    decision.declined = "it has no separate forward and backward (a split call)";
  if (decision.declined.empty() && input.call.wants_row_max && !decision.split.keeps_row_max)
    decision.declined = "it keeps no row maximum (max_scores: the fused tile kernel, on the CPU)";
  if (decision.declined.empty() && input.call.options.sinks().defined() && !spec.takes_sinks) {
    decision.declined = c10::str("the ", spec.name,
                                 " kernel has no attention sinks (the math core and the decode "
                                 "kernel have)");
  }
  return decision;
}

// The first kernel of `table` serving `requested` that takes the input (the kernel the call
// names, whatever it serves); spec null: none. `input_for(spec)` is the input each kernel is
// asked with (by default `input`); `passed_over(spec)` skips a kernel.
template <typename InputFor, typename PassedOver>
Choice first_taking(const KernelInput& input, AttentionBackend requested, const KernelTable& table,
                    const InputFor& input_for, const PassedOver& passed_over) {
  const auto& call = input.call;
  if (call.query.numel() == 0 && !call.split) {
    // Nothing to tile: no batch entry, head or query. The math core answers it (an empty
    // context) on every backend and kernel alike, where the others' tiles and block masks
    // would have nothing to cut.
    for (const auto& spec : table) {
      if (std::string(spec.name) == "math")
        return {&spec, decide(spec, input)};
    }
  }
  const auto& named = input.call.options.kernel();
  for (const auto& spec : table) {
    if (named.empty() ? !serves(spec, requested) || passed_over(spec) : spec.name != named)
      continue;
    auto decision = decide(spec, input_for(spec));
    if (decision.declined.empty())
      return {&spec, std::move(decision)};
  }
  return {};
}

Choice first_taking(const KernelInput& input, AttentionBackend requested,
                    const KernelTable& table) {
  return first_taking(
      input, requested, table, [&](const KernelSpec&) -> const KernelInput& { return input; },
      [](const KernelSpec&) { return false; });
}

std::string lacks(AttentionBackend backend, const KernelInput& input, const KernelTable& table) {
  if (backend == AttentionBackend::kAuto || first_taking(input, backend, table).spec != nullptr)
    return "";
  // The family's most general kernel is its last.
  const KernelSpec* general = nullptr;
  for (const auto& spec : table) {
    if (spec.backend == backend)
      general = &spec;
  }
  TORCH_INTERNAL_ASSERT(general != nullptr, "no kernel serves backend ", backend_name(backend));
  return decide(*general, input).declined;
}

// The kernel for the input in its own dtype: the requested backend's first taker, or, for a
// preference it cannot serve, the table's.
Choice choose(const KernelInput& input, const KernelTable& table) {
  const auto requested = input.call.options.backend();
  auto choice = first_taking(input, requested, table);
  if (choice.spec != nullptr)
    return choice;
  const auto& named = input.call.options.kernel();
  if (!named.empty()) {
    std::string names;
    for (const auto& spec : table) {
      if (spec.name == named) {
        TORCH_CHECK(false, "[attention] kernel ", named,
                    " cannot run this: ", decide(spec, input).declined);
      }
      names += names.empty() ? "" : ", ";
      names += spec.name;
    }
    TORCH_CHECK(false, "[attention] kernel: no kernel is named '", named, "'; expected one of ",
                names);
  }
  TORCH_CHECK(input.call.backend_is_preference, "[attention] backend ", backend_name(requested),
              " cannot run this: ", lacks(requested, input, table),
              "; use AttentionBackend::kAuto, kChunked or kMath");
  choice = first_taking(input, AttentionBackend::kAuto, table);
  // The math core, the table's last, takes every call but a split one.
  TORCH_CHECK(choice.spec != nullptr || !input.call.split, "[attention] ",
              input.call.wants_row_max
                  ? "each row's largest score (max_scores) was asked for, which only the fused "
                    "tile kernel keeps (on the CPU): "
                  : "",
              split_call_lacks(input.call, table));
  TORCH_INTERNAL_ASSERT(choice.spec != nullptr, "the table's last kernel takes every call");
  return choice;
}

// The call on copies of its inputs in `dtype` (each a no-op where it has it already);
// autograd casts the gradients back to the inputs' dtypes. `values` false: uninitialised
// tensors of the copies' shapes and strides, for asking kernels whether they take the copy.
AttentionCall in_dtype(const AttentionCall& call, torch::ScalarType dtype, bool values = true) {
  const auto copy = [&](const torch::Tensor& t) {
    // A stand-in wants a gradient where the copy would (kernels decide by it).
    return values ? t.to(dtype)
                  : torch::empty_like(t, t.options().dtype(dtype))
                        .requires_grad_(t.requires_grad() && torch::GradMode::is_enabled());
  };
  auto cast = call;
  cast.query = copy(call.query);
  cast.key = copy(call.key);
  cast.value = copy(call.value);
  // The packed loop nest would read the projection in its own dtype; the cast views serve.
  if (call.query.scalar_type() != dtype)
    cast.packed_qkv = torch::Tensor();
  return cast;
}

// The call as it runs: under LibTorch's autocast, on its inputs in the autocast dtype.
// (Read before a NoAutocast: inside one, LibTorch 1.13 reports autocast as off.)
std::optional<AttentionCall> autocast_call(const AttentionCall& call) {
  const auto dtype = attention_dtype(call.query);
  if (dtype == call.query.scalar_type() && attention_dtype(call.key) == call.key.scalar_type() &&
      attention_dtype(call.value) == call.value.scalar_type()) {
    return std::nullopt;
  }
  return in_dtype(call, dtype);
}

// A 16-bit call is computed in float32 and its result rounded once, except where its kernel
// runs it in its own dtype: LibTorch's CUDA kernels; on the CPU the fused tile kernel where
// the CPU multiplies the dtype natively (matrix_units.h), and the decode kernel, which reads a
// 16-bit cache in place on any CPU; each keeps the scores, the softmax
// statistics and the accumulators in float32. Other kernels and LibTorch's CPU ops would keep
// them in the 16-bit dtype (and 1.13 has no float16 matrix product on the CPU at all). `plan`
// and `run` see the call as it is computed, with the kernel that computes it, and for a
// 16-bit call how its products ran and why.
template <typename Result, typename Planned>
Result in_its_precision(const AttentionCall& call, const KernelTable& table,
                        const Planned& planned) {
  if (!is_16bit(call.query)) {
    const KernelInput input(call);
    return planned(input, choose(input, table), std::string());
  }
  const auto dtype = call.query.scalar_type();
  std::string why_float32;
  if (call.query.is_cuda()) {
    const KernelInput input(call);
    // A demanded backend that cannot run it is refused (or given way) on the float32 copy.
    auto choice = first_taking(input, call.options.backend(), table);
    if (choice.spec != nullptr && choice.spec->runs_16bit_cuda_in_its_dtype)
      return planned(input, choice, c10::str(dtype, " in LibTorch's CUDA kernel"));
    why_float32 = c10::str("the ", choice.spec != nullptr ? choice.spec->name : "chosen",
                           " kernel computes 16-bit CUDA calls in float32");
  } else if (const auto forced = cpu_16bit_forced_float32(); !forced.empty()) {
    why_float32 = forced;
  } else {
    // The kernel the float32 copy would get (each kernel asked with a stand-in of the copy),
    // but for a kernel that runs the call in its dtype, asked with the call itself; with
    // matrix units, a kernel that yields 16-bit CPU calls to them is passed over unless
    // demanded.
    const auto units_lack = cpu_16bit_matmul_lacks(dtype);
    const bool units = units_lack.empty();
    const auto in_its_dtype = [units](const KernelSpec& spec) {
      return spec.reads_16bit_cpu_in_place || (units && spec.runs_16bit_cpu_in_its_dtype);
    };
    const KernelInput input(call);
    const auto stand_in_call = in_dtype(call, torch::kFloat, /*values=*/false);
    KernelInput stand_in(stand_in_call);  // holds a reference to the call
    stand_in.stands_in_for(input);        // its values are uninitialised
    const auto input_for = [&](const KernelSpec& spec) -> const KernelInput& {
      return in_its_dtype(spec) ? input : stand_in;
    };
    const auto passed_over = [&](const KernelSpec& spec) {
      return units && spec.yields_16bit_cpu_to_matrix_units && !cpu_route_allowed(call) &&
             input.key_tokens() >= kMatrixUnitsFromKeys;
    };
    auto choice = first_taking(input, call.options.backend(), table, input_for, passed_over);
    // A preference its backend cannot serve goes to the table's first taker, as choose().
    if (choice.spec == nullptr && call.backend_is_preference && call.options.kernel().empty())
      choice = first_taking(input, AttentionBackend::kAuto, table, input_for, passed_over);
    if (choice.spec != nullptr && in_its_dtype(*choice.spec)) {
      return planned(input, choice,
                     choice.spec->reads_16bit_cpu_in_place
                         ? c10::str(dtype, " read in place, float32 arithmetic")
                         : c10::str(dtype, " products on ", cpu_16bit_matmul_units(dtype),
                                    " (oneDNN's brgemm), float32 accumulation"));
    }
    why_float32 = !units                   ? units_lack
                  : choice.spec != nullptr ? c10::str("the ", choice.spec->name,
                                                      " kernel computes 16-bit calls in float32")
                                           : "no kernel takes the 16-bit call in its dtype";
  }
  const auto float_call = in_dtype(call, torch::kFloat);
  const KernelInput input(float_call);
  return planned(input, choose(input, table), c10::str("float32: ", why_float32));
}

}  // namespace

// The innermost functional::KernelRecord of this thread, if any.
thread_local F::KernelRecord* t_innermost_record = nullptr;

struct KernelRecordAccess {
  static void append(const AttentionCall& call, const KernelSpec& spec,
                     const std::string& sixteen_bit) {
    if (t_innermost_record != nullptr) {
      t_innermost_record->runs_.push_back(
          {spec.name, call.query.scalar_type(), call.query.device(), sixteen_bit});
    }
  }
  static void open(F::KernelRecord* record) {
    record->outer_ = t_innermost_record;
    t_innermost_record = record;
  }
  static void close(F::KernelRecord* record) { t_innermost_record = record->outer_; }
};

std::string backend_lacks(AttentionBackend backend, const AttentionCall& call,
                          const KernelTable& table) {
  return lacks(backend, KernelInput(call), table);
}

const KernelSpec& plan_attention(const AttentionCall& given, const KernelTable& table) {
  const auto autocast = autocast_call(given);
  return *in_its_precision<const KernelSpec*>(
      autocast ? *autocast : given, table,
      [](const KernelInput&, const Choice& choice, const std::string&) { return choice.spec; });
}

F::AttentionOutput run_attention(const AttentionCall& given, const KernelTable& table) {
  const auto autocast = autocast_call(given);
  NoAutocast no_autocast;
  const auto& call = autocast ? *autocast : given;
  const auto dtype = call.query.scalar_type();
  return in_its_precision<F::AttentionOutput>(
      call, table,
      [dtype](const KernelInput& input, const Choice& choice, const std::string& sixteen_bit) {
        KernelRecordAccess::append(input.call, *choice.spec, sixteen_bit);
        auto out = choice.decision.run(input);
        // A call computed in float32 comes back in its own dtype: rounded once.
        if (out.context.scalar_type() != dtype) {
          out.context = out.context.to(dtype);
          if (out.weights.defined())
            out.weights = out.weights.to(dtype);
        }
        return out;
      });
}

std::string split_call_lacks(const AttentionCall& call, const KernelTable& table) {
  const KernelInput input(call);
  if (first_taking(input, AttentionBackend::kAuto, table).spec != nullptr)
    return "";
  // The fused tile kernel is the split kernel that takes the most calls: its reason.
  for (const auto& spec : table) {
    if (std::string(spec.name) == "fused_tiles")
      return c10::str(
          "no kernel runs it as a split call (fused_tiles: ", decide(spec, input).declined, ")");
  }
  return "no kernel runs it as a split call";
}

SplitForward run_split_forward(const AttentionCall& given, const KernelTable& table) {
  TORCH_INTERNAL_ASSERT(given.split, "run_split_forward needs a split call");
  const auto autocast = autocast_call(given);
  NoAutocast no_autocast;
  const auto& call = autocast ? *autocast : given;
  const auto dtype = call.query.scalar_type();
  return in_its_precision<SplitForward>(
      call, table,
      [dtype](const KernelInput& input, const Choice& choice, const std::string& sixteen_bit) {
        KernelRecordAccess::append(input.call, *choice.spec, sixteen_bit);
        auto [out, lse, row_max] = choice.decision.split.forward(input);
        return SplitForward{out.to(dtype), lse, choice.spec->name,
                            out.scalar_type() != dtype ? out : torch::Tensor(), row_max};
      });
}

std::vector<torch::Tensor> run_split_backward(const AttentionCall& given, const SplitSaved& saved,
                                              const KernelTable& table) {
  TORCH_INTERNAL_ASSERT(given.split, "run_split_backward needs a split call");
  const auto autocast = autocast_call(given);
  NoAutocast no_autocast;
  const auto& call = autocast ? *autocast : given;
  return in_its_precision<std::vector<torch::Tensor>>(
      call, table, [&](const KernelInput& input, const Choice& choice, const std::string&) {
        // Forward's tensors in the dtype the kernel computes in: a 16-bit call's output and
        // log-sum-exp in float32 (its softmax statistics), its output's gradient in its dtype.
        const auto dtype = input.call.query.scalar_type();
        const auto compute = compute_dtype(input.call.query);
        const SplitSaved cast{saved.out.to(compute), saved.lse.to(compute),
                              saved.grad_out.to(dtype), saved.parameters};
        auto grads = choice.decision.split.backward(input, cast);
        // Each gradient in its tensor's dtype (a given tensor's, before autocast).
        grads[0] = grads[0].to(given.query.scalar_type());
        grads[1] = grads[1].to(given.key.scalar_type());
        grads[2] = grads[2].to(given.value.scalar_type());
        for (size_t i = 0; i < saved.parameters.size(); ++i)
          grads[3 + i] = grads[3 + i].to(saved.parameters[i].scalar_type());
        return grads;
      });
}

}  // namespace attnkit::detail

namespace attnkit::functional {

KernelRecord::KernelRecord() : outer_(nullptr) {
  detail::KernelRecordAccess::open(this);
}

KernelRecord::~KernelRecord() {
  detail::KernelRecordAccess::close(this);
}

}  // namespace attnkit::functional
