#include "distributed.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <sstream>
#include <utility>

// ProcessGroupGloo.hpp declares its class only for builds that say Gloo is there.
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef ATTNKIT_WITH_NCCL  // CMake found a CUDA LibTorch and nccl.h
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace attnkit::train {

namespace {

// `name`'s value as an integer in [low, high]; fails naming the variable otherwise.
int integer_variable(const char* name, const char* text, int low, int high) {
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  TORCH_CHECK(*text != '\0' && *end == '\0' && value >= low && value <= high, "environment ", name,
              ": expected an integer in ", low, "..", high, ", got '", text, "'");
  return static_cast<int>(value);
}

// Whether something already listens on TCP `port` (binding as the store's server would).
// Checked first so that the error is attnkit's one line, not c10d's log lines about it.
bool port_in_use(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0)
    return false;
  const int yes = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = htons(static_cast<uint16_t>(port));
  const bool in_use = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 &&
                      errno == EADDRINUSE;
  ::close(fd);
  return in_use;
}

// The store's classic socket server, on every LibTorch: from 2.4 the options default to a
// libuv server, which builds without libuv (Debian's 2.6) refuse; 1.13 has no such option.
template <typename Options>
auto use_classic_store_server(Options& options, int) -> decltype(options.useLibUV = false, void()) {
  options.useLibUV = false;
}
template <typename Options>
void use_classic_store_server(Options&, long) {}

class SingleProcess : public Collectives {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string backend() const override { return "none"; }
  void broadcast_from_main(torch::Tensor&) override {}
  std::function<void()> start_sum(torch::Tensor&) override {
    return [] {};
  }
  std::vector<torch::Tensor> gather_all(const torch::Tensor& tensor) override { return {tensor}; }
  void check_same_on_every_rank(const std::string&, const std::string&) override {}
  std::function<void()> start_send_receive(const std::vector<torch::Tensor>& send, int,
                                           std::vector<torch::Tensor>& receive, int) override {
    for (size_t i = 0; i < send.size(); ++i)
      receive[i].copy_(send[i]);
    return [] {};
  }
};

// The first line where `a` and `b` differ ("" for the end of the text).
std::pair<std::string, std::string> first_difference(const std::string& a, const std::string& b) {
  std::istringstream in_a(a), in_b(b);
  std::string line_a, line_b;
  while (true) {
    const bool more_a = static_cast<bool>(std::getline(in_a, line_a));
    const bool more_b = static_cast<bool>(std::getline(in_b, line_b));
    if (!more_a && !more_b)
      return {"", ""};
    if (!more_a)
      line_a.clear();
    if (!more_b)
      line_b.clear();
    if (line_a != line_b)
      return {line_a, line_b};
  }
}

std::string first_line(const std::string& text) {
  return text.substr(0, text.find('\n'));
}

// What a rank that waited in vain for the others is told, with c10d's `detail` (which said
// only "Socket Timeout", or blamed the port).
std::string not_all_joined(const RankEnvironment& env, int timeout_s, const std::string& detail) {
  return c10::str("the ", env.world_size, " ranks did not all join the run at ", env.master_addr,
                  ":", env.master_port, " within ", timeout_s, " s: start every rank 0..",
                  env.world_size - 1,
                  " with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE (or a WORLD_SIZE of as "
                  "many ranks as run; --dist-timeout waits longer): ",
                  first_line(detail));
}

// The rendezvous: rank 0 opens the store at MASTER_ADDR:MASTER_PORT, the others connect.
c10::intrusive_ptr<c10d::Store> open_store(const RankEnvironment& env, int timeout_s) {
  // An address that does not resolve (256.1.1.1) waited the whole timeout, then blamed the
  // port.
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int resolved = ::getaddrinfo(env.master_addr.c_str(), nullptr, &hints, &found);
  if (found != nullptr)
    ::freeaddrinfo(found);
  TORCH_CHECK(resolved == 0, "environment MASTER_ADDR: cannot resolve '", env.master_addr, "' (",
              ::gai_strerror(resolved), "): give rank 0's host name or IP address");
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(env.master_port);
  options.isServer = env.rank == 0;
  options.numWorkers = static_cast<std::size_t>(env.world_size);
  options.waitWorkers = true;
  options.timeout = std::chrono::milliseconds(1000LL * timeout_s);
  use_classic_store_server(options, 0);
  TORCH_CHECK(env.rank != 0 || !port_in_use(env.master_port),
              "cannot open the rendezvous store on ", env.master_addr, ":", env.master_port,
              ": the port is already in use; choose another MASTER_PORT");
  try {
    return c10::make_intrusive<c10d::TCPStore>(env.master_addr, options);
  } catch (const std::exception& e) {
    // The port was free: rank 0 waited for the others (2.x waits here, 1.13 in the group).
    TORCH_CHECK(env.rank != 0, not_all_joined(env, timeout_s, e.what()));
    TORCH_CHECK(false, "cannot reach the rendezvous store at ", env.master_addr, ":",
                env.master_port, " within ", timeout_s,
                " s (did rank 0 start?): ", first_line(e.what()));
  }
}

c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                      const RankEnvironment& env, int timeout_s) {
  auto options =
      c10d::ProcessGroupGloo::Options::create(std::chrono::milliseconds(1000LL * timeout_s));
  // Gloo's network interface: GLOO_SOCKET_IFNAME's, as PyTorch reads it; else loopback for
  // a local run, else the one this host's name resolves to.
  const bool local = env.master_addr == "localhost" || env.master_addr.rfind("127.", 0) == 0;
  const char* interface = std::getenv("GLOO_SOCKET_IFNAME");
  options->devices.push_back(interface != nullptr && *interface != '\0'
                                 ? c10d::ProcessGroupGloo::createDeviceForInterface(interface)
                             : local ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                                     : c10d::ProcessGroupGloo::createDefaultDevice());
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, env.rank, env.world_size, options);
}

#ifdef ATTNKIT_WITH_NCCL
c10::intrusive_ptr<c10d::ProcessGroupNCCL> nccl_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                      const RankEnvironment& env, int timeout_s) {
  // Blocking waits: a collective that waits longer than the timeout for a rank throws (and
  // attnkit names the lost rank) instead of NCCL's watchdog aborting the process.
  // TORCH_NCCL_BLOCKING_WAIT is 2.x's name, NCCL_BLOCKING_WAIT 1.13's; a user's setting wins.
  setenv("TORCH_NCCL_BLOCKING_WAIT", "1", /*overwrite=*/0);
  setenv("NCCL_BLOCKING_WAIT", "1", /*overwrite=*/0);
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = std::chrono::milliseconds(1000LL * timeout_s);
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, env.rank, env.world_size, options);
}
#endif

// A c10d process group of either backend; tensors go through `device_` (the backend's:
// host memory for Gloo, this rank's GPU for NCCL) when they are elsewhere.
template <typename Group>
class C10dCollectives : public Collectives {
 public:
  C10dCollectives(const RankEnvironment& env, c10::intrusive_ptr<c10d::Store> store,
                  c10::intrusive_ptr<Group> group, std::string backend, torch::Device device)
      : rank_(env.rank),
        world_size_(env.world_size),
        store_(std::move(store)),
        group_(std::move(group)),
        backend_(std::move(backend)),
        device_(device) {}

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  std::string backend() const override { return backend_; }

  void broadcast_from_main(torch::Tensor& tensor) override {
    on_device(tensor, "broadcast", [&](std::vector<at::Tensor>& tensors) {
      return group_->broadcast(tensors, c10d::BroadcastOptions());
    });
  }

  std::function<void()> start_sum(torch::Tensor& tensor) override {
    const auto allreduce = [&](std::vector<at::Tensor>& tensors) {
      return group_->allreduce(tensors, c10d::AllreduceOptions());
    };
    if (tensor.device() == device_ && tensor.is_contiguous()) {
      std::vector<at::Tensor> tensors{tensor};
      return [this, work = allreduce(tensors)] { wait("allreduce", work); };
    }
    on_device(tensor, "allreduce", allreduce);  // through a copy: done before returning
    return [] {};
  }

  std::vector<torch::Tensor> gather_all(const torch::Tensor& tensor) override {
    std::vector<at::Tensor> input{tensor.to(device_).contiguous()};
    std::vector<std::vector<at::Tensor>> output(1);
    for (int r = 0; r < world_size_; ++r)
      output[0].push_back(torch::empty_like(input[0]));
    wait("allgather", group_->allgather(output, input));
    for (auto& t : output[0])
      t = t.to(tensor.device());
    return output[0];
  }

  std::function<void()> start_send_receive(const std::vector<torch::Tensor>& send, int to,
                                           std::vector<torch::Tensor>& receive, int from) override {
    TORCH_CHECK(send.size() == receive.size() && to >= 0 && to < world_size_ && from >= 0 &&
                    from < world_size_,
                "[start_send_receive] expected as many tensors to receive as to send and ranks "
                "in [0, ",
                world_size_, "), got ", send.size(), " and ", receive.size(), " tensors, to ", to,
                ", from ", from);
    // Every rank makes its calls in the same order, so a count of them gives the matching
    // tags; one tensor per message (Gloo's rule).
    const int tag = static_cast<int>((transfers_++ % 100000) * 16);
    TORCH_CHECK(send.size() <= 16, "[start_send_receive] at most 16 tensors, got ", send.size());
    struct Pending {
      std::vector<at::Tensor> sent, landing;
      std::vector<c10::intrusive_ptr<c10d::Work>> sends, receives;
    };
    auto pending = std::make_shared<Pending>();
    for (size_t i = 0; i < send.size(); ++i) {
      pending->sent.push_back(send[i].to(device_).contiguous());
      std::vector<at::Tensor> one{pending->sent.back()};
      pending->sends.push_back(group_->send(one, to, tag + static_cast<int>(i)));
    }
    for (size_t i = 0; i < receive.size(); ++i) {
      const bool direct = receive[i].device() == device_ && receive[i].is_contiguous();
      pending->landing.push_back(
          direct ? receive[i]
                 : torch::empty(receive[i].sizes(), receive[i].options().device(device_)));
      std::vector<at::Tensor> one{pending->landing.back()};
      pending->receives.push_back(group_->recv(one, from, tag + static_cast<int>(i)));
    }
    return [this, pending, receive, to, from]() mutable {
      for (auto& work : pending->sends)
        wait_for(to, "a send to", work);
      for (auto& work : pending->receives)
        wait_for(from, "a receive from", work);
      for (size_t i = 0; i < receive.size(); ++i) {
        if (!pending->landing[i].is_same(receive[i]))
          receive[i].copy_(pending->landing[i]);
      }
    };
  }

  void check_same_on_every_rank(const std::string& what, const std::string& text) override {
    // Keys of their own per check: the store keeps the last check's texts.
    const std::string prefix = "attnkit/" + what + "/" + std::to_string(checks_++) + "/";
    store_->set(prefix + std::to_string(rank_), std::vector<uint8_t>(text.begin(), text.end()));
    std::vector<std::string> texts, read_keys;
    for (int r = 0; r < world_size_; ++r) {
      const auto bytes = store_->get(prefix + std::to_string(r));  // waits for rank r
      texts.emplace_back(bytes.begin(), bytes.end());
      read_keys.push_back(prefix + "read/" + std::to_string(r));
    }
    // Rank 0 holds the store: it must not leave (on a mismatch) before every rank has read
    // every text, nor before each has had the answer to its wait.
    store_->set(read_keys[rank_], std::vector<uint8_t>{1});
    store_->wait(read_keys);
    if (rank_ > 0) {
      store_->set(prefix + "done/" + std::to_string(rank_), std::vector<uint8_t>{1});
    } else {
      std::vector<std::string> done_keys;
      for (int r = 1; r < world_size_; ++r)
        done_keys.push_back(prefix + "done/" + std::to_string(r));
      store_->wait(done_keys);
    }
    for (int r = 0; r < world_size_; ++r) {
      if (texts[r] == text)
        continue;
      const auto [mine, theirs] = first_difference(text, texts[r]);
      TORCH_CHECK(false, "ranks started with different ", what, ": rank ", rank_, " has '", mine,
                  "', rank ", r, " has '", theirs, "'");
    }
  }

 private:
  // Waits for a collective; a failure (a rank died or stopped answering) names this rank.
  void wait(const char* what, const c10::intrusive_ptr<c10d::Work>& work) {
    try {
      work->wait();
    } catch (const std::exception& e) {
      const std::string other =
          world_size_ == 2 ? c10::str("rank ", 1 - rank_) : std::string("another rank");
      throw RankLost(c10::str("lost ", other, " during ", what, " (", first_line(e.what()), ")"));
    }
  }

  // Waits for a transfer with rank `peer`; a failure names that rank.
  void wait_for(int peer, const char* what, const c10::intrusive_ptr<c10d::Work>& work) {
    try {
      work->wait();
    } catch (const std::exception& e) {
      throw RankLost(c10::str("lost rank ", peer, " during ", what, " rank ", peer, " (",
                              first_line(e.what()), ")"));
    }
  }

  // Runs a collective on `tensor`, through a contiguous copy on the backend's device if the
  // tensor is elsewhere.
  template <typename Start>
  void on_device(torch::Tensor& tensor, const char* what, const Start& start) {
    std::vector<at::Tensor> tensors{tensor.device() == device_ && tensor.is_contiguous()
                                        ? tensor
                                        : tensor.to(device_).contiguous()};
    wait(what, start(tensors));
    if (!tensors[0].is_same(tensor))
      tensor.copy_(tensors[0]);
  }

  int rank_, world_size_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<Group> group_;
  std::string backend_;
  torch::Device device_;
  int64_t transfers_ = 0;
  int64_t checks_ = 0;  // check_same_on_every_rank calls so far
};

}  // namespace

RankEnvironment read_rank_environment(const std::function<const char*(const char*)>& lookup) {
  const auto get = [&](const char* name) -> const char* {
    return lookup ? lookup(name) : std::getenv(name);
  };
  RankEnvironment env;
  const char* world_size = get("WORLD_SIZE");
  const char* rank = get("RANK");
  if (world_size == nullptr) {
    TORCH_CHECK(rank == nullptr, "environment RANK is set (", rank,
                ") but WORLD_SIZE is not: set both, or neither for one process");
    return env;
  }
  env.launched = true;
  env.world_size = integer_variable("WORLD_SIZE", world_size, 1, 65536);
  TORCH_CHECK(rank != nullptr, "environment WORLD_SIZE is set (", world_size,
              ") but RANK is not: every process needs its RANK, 0..", env.world_size - 1);
  env.rank = integer_variable("RANK", rank, 0, env.world_size - 1);
  const char* local_rank = get("LOCAL_RANK");
  env.local_rank =
      local_rank ? integer_variable("LOCAL_RANK", local_rank, 0, env.world_size - 1) : env.rank;
  if (const char* local_world_size = get("LOCAL_WORLD_SIZE"); local_world_size != nullptr) {
    env.local_world_size =
        integer_variable("LOCAL_WORLD_SIZE", local_world_size, env.local_rank + 1, env.world_size);
  }
  if (const char* addr = get("MASTER_ADDR"); addr != nullptr) {
    TORCH_CHECK(*addr != '\0', "environment MASTER_ADDR: expected a host name or address, got ''");
    env.master_addr = addr;
  } else {
    TORCH_CHECK(env.world_size == 1, "environment MASTER_ADDR is not set: ranks of a ",
                env.world_size, "-process run need rank 0's address");
  }
  if (const char* port = get("MASTER_PORT"); port != nullptr) {
    env.master_port = integer_variable("MASTER_PORT", port, 1, 65535);
  } else {
    TORCH_CHECK(env.world_size == 1, "environment MASTER_PORT is not set: ranks of a ",
                env.world_size, "-process run need rank 0's port");
  }
  return env;
}

RankRange::RankRange(Collectives& group, int first, int size)
    : group_(group), first_(first), size_(size) {
  TORCH_CHECK(size >= 1 && first >= 0 && first + size <= group.world_size() &&
                  group.rank() >= first && group.rank() < first + size,
              "[RankRange] ranks [", first, ", ", first + size, ") must hold rank ", group.rank(),
              " and lie within the group's ", group.world_size());
}

std::unique_ptr<Collectives> single_process() {
  return std::make_unique<SingleProcess>();
}

bool nccl_available() {
#ifdef ATTNKIT_WITH_NCCL
  return true;
#else
  return false;
#endif
}

std::string choose_dist_backend(const std::string& requested, const torch::Device& device,
                                const RankEnvironment& environment) {
  TORCH_CHECK(requested == "auto" || requested == "gloo" || requested == "nccl",
              "--dist-backend: expected auto, gloo or nccl, got '", requested, "'");
  if (requested != "auto")
    return requested;
  if (!nccl_available() || !device.is_cuda())
    return "gloo";
  // Plain cuda puts local rank r on GPU r (rank_device): NCCL needs a GPU for each.
  const bool gpu_each = device.has_index() || environment.local_world_size <=
                                                  static_cast<int>(torch::cuda::device_count());
  return gpu_each ? "nccl" : "gloo";
}

std::unique_ptr<Collectives> join_process_group(const RankEnvironment& environment,
                                                const std::string& backend, int timeout_s,
                                                const torch::Device& device) {
  TORCH_CHECK(backend == "gloo" || backend == "nccl",
              "--dist-backend: expected gloo or nccl, got '", backend, "'");
  check_backend_serves(backend, device);
  // A write to the socket of a rank that died must fail with EPIPE, which c10d turns into the
  // "lost rank" error, not kill this rank with SIGPIPE (Python ignores SIGPIPE; C++ does not).
  std::signal(SIGPIPE, SIG_IGN);
  auto store = open_store(environment, timeout_s);
  try {
#ifdef ATTNKIT_WITH_NCCL
    if (backend == "nccl") {
      return std::make_unique<C10dCollectives<c10d::ProcessGroupNCCL>>(
          environment, store, nccl_group(store, environment, timeout_s), backend, device);
    }
#endif
    return std::make_unique<C10dCollectives<c10d::ProcessGroupGloo>>(
        environment, store, gloo_group(store, environment, timeout_s), backend, torch::kCPU);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, not_all_joined(environment, timeout_s, e.what()));
  }
}

void check_backend_serves(const std::string& backend, const torch::Device& device) {
  if (backend != "nccl")
    return;
  TORCH_CHECK(device.is_cuda(),
              "--dist-backend nccl: NCCL reduces GPU tensors and needs "
              "--device cuda, got --device ",
              device.str(), "; use --dist-backend gloo");
  TORCH_CHECK(nccl_available(),
              "--dist-backend nccl: this attnkit-train was built without NCCL (that needs a "
              "CUDA LibTorch and NCCL's nccl.h when configuring); use --dist-backend gloo");
}

torch::Device rank_device(const torch::Device& device, const RankEnvironment& environment,
                          const std::string& backend) {
  if (!device.is_cuda() || device.has_index() || !environment.launched)
    return device;
  const int visible = static_cast<int>(torch::cuda::device_count());
  // NCCL cannot put two ranks of one group on one GPU.
  TORCH_CHECK(backend != "nccl" || environment.local_rank < visible,
              "--dist-backend nccl: LOCAL_RANK ", environment.local_rank, " needs GPU ",
              environment.local_rank, " but ", visible, " GPU(s) are visible: start at most ",
              visible, " ranks on this machine, or use --dist-backend gloo");
  return torch::Device(torch::kCUDA,
                       static_cast<c10::DeviceIndex>(environment.local_rank % visible));
}

int free_local_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TORCH_CHECK(fd >= 0, "--nproc: cannot open a socket to find a free port");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;  // the kernel picks
  socklen_t length = sizeof(address);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  ::close(fd);
  TORCH_CHECK(ok, "--nproc: cannot find a free port on 127.0.0.1");
  return ntohs(address.sin_port);
}

}  // namespace attnkit::train
