#include "io/tensor_unpickler.h"

#include <array>
#include <cstring>
#include <limits>
#include <memory>
#include <unordered_map>
#include <vector>

#include "io/read_failure.h"

namespace attnkit::detail {

namespace {

// Deeper than a dict of tensors ever is (dict > rebuild call > argument tuple > size tuple),
// with room for a state dict's _metadata; a pickle nested deeper is refused.
constexpr int kMaxNesting = 32;
// More dimensions than any tensor LibTorch makes (it refuses more than 64 itself).
constexpr int64_t kMaxDims = 64;

struct Value {
  enum class Kind {
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kTuple,
    kList,
    kDict,
    kGlobal,
    kStorage,
    kTensor
  };
  Kind kind = Kind::kNone;
  int64_t integer = 0;                // kInt, kBool
  std::string text;                   // kString; kGlobal: "module name"
  std::vector<Value*> items;          // kTuple, kList; kDict: key, value, key, value, ...
  int depth = 1;                      // containers: 1 + their deepest item
  at::ScalarType dtype = at::kFloat;  // kStorage
  at::Storage storage;                // kStorage
  torch::Tensor tensor;               // kTensor
};

const char* kind_name(Value::Kind kind) {
  static constexpr std::array<const char*, 11> kNames{"None",   "bool",    "int",   "float",
                                                      "str",    "tuple",   "list",  "dict",
                                                      "global", "storage", "tensor"};
  return kNames[static_cast<size_t>(kind)];
}

// torch.<Type>Storage: the dtype of a storage as torch.save names it.
bool storage_dtype(const std::string& global, at::ScalarType* dtype) {
  static const std::unordered_map<std::string, at::ScalarType> kStorages{
      {"torch FloatStorage", at::kFloat},
      {"torch DoubleStorage", at::kDouble},
      {"torch HalfStorage", at::kHalf},
      {"torch BFloat16Storage", at::kBFloat16},
      {"torch LongStorage", at::kLong},
      {"torch IntStorage", at::kInt},
      {"torch ShortStorage", at::kShort},
      {"torch CharStorage", at::kChar},
      {"torch ByteStorage", at::kByte},
      {"torch BoolStorage", at::kBool},
      {"torch ComplexFloatStorage", at::kComplexFloat},
      {"torch ComplexDoubleStorage", at::kComplexDouble}};
  const auto found = kStorages.find(global);
  if (found == kStorages.end())
    return false;
  *dtype = found->second;
  return true;
}

// The C++ counterpart of PyTorch's weights-only unpickler: protocol 2's opcodes for dicts,
// tuples, numbers and strings; the globals a dict of tensors names, nothing else. Values live
// in an arena owned by the reader, so a pickle that refers to itself leaks nothing, and no
// code walks values recursively.
class TensorUnpickler {
 public:
  TensorUnpickler(const std::string& pickle, const std::string& name, StorageLoader load_storage)
      : pickle_(pickle), name_(name), load_storage_(std::move(load_storage)) {}

  Value* run() {
    while (true) {
      const uint64_t at = position_;
      const auto opcode = next_byte();
      switch (opcode) {
        case 0x80:  // PROTO
          take(1);
          break;
        case '.':  // STOP
          if (stack_.size() != 1 || !marks_.empty())
            bad(at, "STOP leaves ", stack_.size(), " values behind");
          return stack_.back();
        case 'c': {  // GLOBAL: "module\nname\n"
          const std::string module = line();
          push(global(module, line()));
          break;
        }
        case 'q':  // BINPUT
          memo_[next_byte()] = top(at);
          break;
        case 'r':  // LONG_BINPUT
          memo_[static_cast<uint32_t>(little_endian(4))] = top(at);
          break;
        case 'h':  // BINGET
          push(memo(at, next_byte()));
          break;
        case 'j':  // LONG_BINGET
          push(memo(at, static_cast<uint32_t>(little_endian(4))));
          break;
        case '(':  // MARK
          if (marks_.size() >= static_cast<size_t>(kMaxNesting))
            bad(at, "nests deeper than ", kMaxNesting, " levels");
          marks_.push_back(stack_.size());
          break;
        case '}':  // EMPTY_DICT
          push(make(Value::Kind::kDict));
          break;
        case ']':  // EMPTY_LIST
          push(make(Value::Kind::kList));
          break;
        case ')':  // EMPTY_TUPLE
          push(make(Value::Kind::kTuple));
          break;
        case 't':  // TUPLE
          push(container(at, Value::Kind::kTuple, pop_to_mark(at)));
          break;
        case 0x85:  // TUPLE1
        case 0x86:  // TUPLE2
        case 0x87:  // TUPLE3
          push(container(at, Value::Kind::kTuple, pop(at, opcode - 0x84)));
          break;
        case 'X': {  // BINUNICODE
          const uint64_t length = little_endian(4);
          push(string(take(length)));
          break;
        }
        case 0x8c: {  // SHORT_BINUNICODE
          const uint64_t length = next_byte();
          push(string(take(length)));
          break;
        }
        case 'K':  // BININT1
          push(integer(next_byte()));
          break;
        case 'M':  // BININT2
          push(integer(static_cast<int64_t>(little_endian(2))));
          break;
        case 'J':  // BININT
          push(integer(static_cast<int32_t>(static_cast<uint32_t>(little_endian(4)))));
          break;
        case 0x8a: {  // LONG1
          const int length = next_byte();
          if (length > 8)
            bad(at, "has an integer of ", length, " bytes (at most 8 fit a tensor's sizes)");
          uint64_t value = length == 0 ? 0 : little_endian(length);
          if (length > 0 && length < 8 && (value >> (8 * length - 1)) != 0)
            value |= ~uint64_t{0} << (8 * length);  // sign-extend
          push(integer(static_cast<int64_t>(value)));
          break;
        }
        case 'N':  // NONE
          push(make(Value::Kind::kNone));
          break;
        case 0x88:    // NEWTRUE
        case 0x89: {  // NEWFALSE
          Value* value = make(Value::Kind::kBool);
          value->integer = opcode == 0x88;
          push(value);
          break;
        }
        case 'G': {  // BINFLOAT (big-endian)
          const std::string raw = take(8);
          uint64_t bits = 0;
          for (char byte : raw)
            bits = (bits << 8) | static_cast<unsigned char>(byte);
          Value* value = make(Value::Kind::kFloat);
          std::memcpy(&value->integer, &bits, sizeof(bits));  // kept as its bits; never used
          push(value);
          break;
        }
        case 'R': {  // REDUCE
          Value* arguments = pop(at, 1)[0];
          Value* callable = pop(at, 1)[0];
          push(reduce(at, callable, arguments));
          break;
        }
        case 'b': {  // BUILD: only an OrderedDict's attributes (a state dict's _metadata)
          Value* state = pop(at, 1)[0];
          Value* object = top(at);
          if (object->kind != Value::Kind::kDict ||
              (state->kind != Value::Kind::kDict && state->kind != Value::Kind::kNone))
            bad(at, "sets the state of a ", kind_name(object->kind), " (only an OrderedDict's)");
          break;
        }
        case 's': {  // SETITEM
          auto key_value = pop(at, 2);
          add_items(at, top(at), Value::Kind::kDict, key_value);
          break;
        }
        case 'u': {  // SETITEMS
          auto items = pop_to_mark(at);
          if (items.size() % 2 != 0)
            bad(at, "SETITEMS with a key and no value");
          add_items(at, top(at), Value::Kind::kDict, items);
          break;
        }
        case 'a':  // APPEND
          add_items(at, nullptr, Value::Kind::kList, pop(at, 1));
          break;
        case 'e':  // APPENDS
          add_items(at, nullptr, Value::Kind::kList, pop_to_mark(at));
          break;
        case 'Q':  // BINPERSID
          push(storage(at, pop(at, 1)[0]));
          break;
        default:
          bad(at, "has pickle opcode 0x", hex(opcode),
              ", which a dict of tensors does not need (only what torch.save writes for one is "
              "read)");
      }
    }
  }

 private:
  template <typename... Args>
  [[noreturn]] void bad(uint64_t at, const Args&... args) const {
    read_failure(name_, "is not a dict of tensors: its data.pkl, at byte ", at, ", ", args..., "; ",
                 kPythonHint);
  }

  static std::string hex(unsigned value) {
    constexpr const char* kDigits = "0123456789abcdef";
    return {kDigits[(value >> 4) & 15], kDigits[value & 15]};
  }

  std::string take(uint64_t count) {
    if (count > pickle_.size() - position_)
      read_failure(name_, "is damaged: its data.pkl ends in the middle of an item (byte ",
                   position_, " of ", pickle_.size(), ")");
    std::string bytes = pickle_.substr(position_, count);
    position_ += count;
    return bytes;
  }
  unsigned char next_byte() { return static_cast<unsigned char>(take(1)[0]); }
  uint64_t little_endian(int width) {
    const std::string raw = take(width);
    uint64_t value = 0;
    for (int i = width - 1; i >= 0; --i)
      value = (value << 8) | static_cast<unsigned char>(raw[i]);
    return value;
  }
  std::string line() {
    const auto end = pickle_.find('\n', position_);
    if (end == std::string::npos)
      read_failure(name_, "is damaged: its data.pkl ends inside a global's name");
    std::string text = pickle_.substr(position_, end - position_);
    position_ = end + 1;
    return text;
  }

  Value* make(Value::Kind kind) {
    arena_.push_back(std::make_unique<Value>());
    arena_.back()->kind = kind;
    return arena_.back().get();
  }
  Value* string(std::string text) {
    Value* value = make(Value::Kind::kString);
    value->text = std::move(text);
    return value;
  }
  Value* integer(int64_t number) {
    Value* value = make(Value::Kind::kInt);
    value->integer = number;
    return value;
  }
  Value* container(uint64_t at, Value::Kind kind, const std::vector<Value*>& items) {
    Value* value = make(kind);
    value->items = items;
    for (const Value* item : items)
      value->depth = std::max(value->depth, item->depth + 1);
    if (value->depth > kMaxNesting)
      bad(at, "nests deeper than ", kMaxNesting, " levels");
    return value;
  }
  Value* global(const std::string& module, const std::string& name) {
    const std::string full = module + " " + name;
    at::ScalarType dtype;
    if (full != "collections OrderedDict" && full != "torch._utils _rebuild_tensor_v2" &&
        full != "torch._utils _rebuild_parameter" && !storage_dtype(full, &dtype))
      bad(position_, "names the global '", module, ".", name,
          "', which a dict of tensors does not need");
    Value* value = make(Value::Kind::kGlobal);
    value->text = full;
    return value;
  }

  void push(Value* value) { stack_.push_back(value); }
  Value* top(uint64_t at) const {
    if (stack_.size() <= (marks_.empty() ? 0 : marks_.back()))
      bad(at, "uses a value that is not there (the stack is empty)");
    return stack_.back();
  }
  std::vector<Value*> pop(uint64_t at, size_t count) {
    const size_t floor = marks_.empty() ? 0 : marks_.back();
    if (stack_.size() < floor + count)
      bad(at, "takes ", count, " values from a stack that has ", stack_.size() - floor);
    std::vector<Value*> values(stack_.end() - count, stack_.end());
    stack_.resize(stack_.size() - count);
    return values;
  }
  std::vector<Value*> pop_to_mark(uint64_t at) {
    if (marks_.empty())
      bad(at, "closes a MARK that was never opened");
    std::vector<Value*> values(stack_.begin() + marks_.back(), stack_.end());
    stack_.resize(marks_.back());
    marks_.pop_back();
    return values;
  }
  Value* memo(uint64_t at, uint32_t index) const {
    const auto found = memo_.find(index);
    if (found == memo_.end())
      bad(at, "refers to memo entry ", index, ", which was never stored");
    return found->second;
  }

  // `target` null: the list on top of the stack.
  void add_items(uint64_t at, Value* target, Value::Kind kind, const std::vector<Value*>& items) {
    if (target == nullptr)
      target = top(at);
    if (target->kind != kind)
      bad(at, "adds items to a ", kind_name(target->kind), ", expected a ", kind_name(kind));
    for (Value* item : items) {
      target->items.push_back(item);
      target->depth = std::max(target->depth, item->depth + 1);
    }
    if (target->depth > kMaxNesting)
      bad(at, "nests deeper than ", kMaxNesting, " levels");
  }

  int64_t expect_int(uint64_t at, const Value* value, const char* what) const {
    if (value->kind != Value::Kind::kInt)
      bad(at, what, " is a ", kind_name(value->kind), ", expected an int");
    return value->integer;
  }
  std::vector<int64_t> expect_ints(uint64_t at, const Value* value, const char* what) const {
    if (value->kind != Value::Kind::kTuple)
      bad(at, what, " is a ", kind_name(value->kind), ", expected a tuple of ints");
    if (static_cast<int64_t>(value->items.size()) > kMaxDims)
      bad(at, what, " has ", value->items.size(), " dimensions, at most ", kMaxDims);
    std::vector<int64_t> numbers;
    for (const Value* item : value->items) {
      numbers.push_back(expect_int(at, item, what));
      if (numbers.back() < 0)
        bad(at, what, " has a negative entry (", numbers.back(), ")");
    }
    return numbers;
  }

  Value* reduce(uint64_t at, const Value* callable, const Value* arguments) {
    if (callable->kind != Value::Kind::kGlobal || arguments->kind != Value::Kind::kTuple)
      bad(at, "calls a ", kind_name(callable->kind), " with a ", kind_name(arguments->kind));
    const auto& args = arguments->items;
    if (callable->text == "collections OrderedDict") {
      if (!args.empty())
        bad(at, "calls OrderedDict with arguments");
      return make(Value::Kind::kDict);
    }
    if (callable->text == "torch._utils _rebuild_parameter") {
      if (args.size() != 3 || args[0]->kind != Value::Kind::kTensor)
        bad(at, "calls _rebuild_parameter without a tensor");
      return args[0];
    }
    if (callable->text != "torch._utils _rebuild_tensor_v2")
      bad(at, "calls '", callable->text, "', which makes no value of a dict of tensors");
    // (storage, storage_offset, size, stride, requires_grad, backward_hooks[, metadata])
    if ((args.size() != 6 && args.size() != 7) || args[0]->kind != Value::Kind::kStorage)
      bad(at, "calls _rebuild_tensor_v2 with ", args.size(),
          " arguments, expected a storage and 5 more");
    const Value& storage = *args[0];
    const int64_t offset = expect_int(at, args[1], "a tensor's storage offset");
    const auto sizes = expect_ints(at, args[2], "a tensor's size");
    const auto strides = expect_ints(at, args[3], "a tensor's stride");
    if (offset < 0 || sizes.size() != strides.size())
      bad(at, "rebuilds a tensor with offset ", offset, ", ", sizes.size(), " sizes and ",
          strides.size(), " strides");
    // The last element the tensor reaches must lie inside its storage; no overflow on the way.
    const int64_t storage_numel =
        static_cast<int64_t>(storage.storage.nbytes() / c10::elementSize(storage.dtype));
    int64_t numel = 1, last = offset;
    bool overflow = false;
    for (size_t d = 0; d < sizes.size(); ++d) {
      int64_t reach = 0;
      overflow |= __builtin_mul_overflow(sizes[d], numel, &numel);
      if (sizes[d] > 0) {
        overflow |= __builtin_mul_overflow(sizes[d] - 1, strides[d], &reach);
        overflow |= __builtin_add_overflow(last, reach, &last);
      }
    }
    if (overflow || (numel > 0 && last >= storage_numel))
      bad(at, "has a tensor of size ", c10::IntArrayRef(sizes), " and stride ",
          c10::IntArrayRef(strides), " at offset ", offset, " that reaches past its storage of ",
          storage_numel, " elements");
    Value* value = make(Value::Kind::kTensor);
    value->tensor = torch::empty({0}, torch::TensorOptions().dtype(storage.dtype))
                        .set_(storage.storage, offset, sizes, strides);
    return value;
  }

  // ('storage', torch.<Type>Storage, key, location, numel): data/<key>, read once per key.
  Value* storage(uint64_t at, const Value* id) {
    const auto& parts = id->items;
    if (id->kind != Value::Kind::kTuple || parts.size() != 5 ||
        parts[0]->kind != Value::Kind::kString || parts[0]->text != "storage" ||
        parts[1]->kind != Value::Kind::kGlobal || parts[2]->kind != Value::Kind::kString ||
        parts[3]->kind != Value::Kind::kString)
      bad(at, "has a persistent id that is not ('storage', type, key, location, numel)");
    at::ScalarType dtype;
    if (!storage_dtype(parts[1]->text, &dtype))
      bad(at, "names '", parts[1]->text, "' as a storage type");
    const std::string& key = parts[2]->text;
    const int64_t numel = expect_int(at, parts[4], "a storage's element count");
    const auto cached = storages_.find(key);
    if (cached != storages_.end()) {
      if (cached->second->dtype != dtype)
        bad(at, "reads storage '", key, "' as two dtypes");
      return cached->second;
    }
    const auto [data, bytes] = load_storage_(key);
    const uint64_t element = c10::elementSize(dtype);
    if (numel < 0 || bytes % element != 0 || static_cast<uint64_t>(numel) != bytes / element)
      bad(at, "says storage '", key, "' holds ", numel, " elements of ", element,
          " bytes, its record has ", bytes, " bytes");
    Value* value = make(Value::Kind::kStorage);
    value->dtype = dtype;
    auto tensor = torch::empty({numel}, torch::TensorOptions().dtype(dtype));
    if (bytes > 0)
      std::memcpy(tensor.data_ptr(), data, bytes);
    value->storage = tensor.storage();
    storages_.emplace(key, value);
    return value;
  }

  const std::string& pickle_;
  const std::string& name_;
  StorageLoader load_storage_;
  uint64_t position_ = 0;
  std::vector<std::unique_ptr<Value>> arena_;
  std::vector<Value*> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint32_t, Value*> memo_;
  std::unordered_map<std::string, Value*> storages_;
};

}  // namespace

StateDict unpickle_state_dict(const std::string& pickle, const std::string& name,
                              const StorageLoader& load_storage) {
  TensorUnpickler unpickler(pickle, name, load_storage);
  const Value* root = unpickler.run();
  if (root->kind != Value::Kind::kDict)
    read_failure(name, "holds a ", kind_name(root->kind), ", not a dict; ", kPythonHint);
  StateDict dict;
  for (size_t i = 0; i + 1 < root->items.size(); i += 2) {
    const Value* key = root->items[i];
    const Value* value = root->items[i + 1];
    if (key->kind != Value::Kind::kString)
      read_failure(name, "has a key that is a ", kind_name(key->kind), ", expected strings; ",
                   kPythonHint);
    if (value->kind != Value::Kind::kTensor)
      read_failure(name, "has a value of key '", key->text, "' that is a ", kind_name(value->kind),
                   ", expected a tensor; ", kPythonHint);
    if (auto* existing = dict.find(key->text)) {
      *existing = value->tensor;  // a repeated key: the last value wins, as in Python
    } else {
      dict.insert(key->text, value->tensor);
    }
  }
  return dict;
}

}  // namespace attnkit::detail
