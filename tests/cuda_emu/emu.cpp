// The scheduler of emu.h: fibers per block, warps settled at their stop points, blocks spread
// over OS threads.
#include "emu.h"

#include <c10/util/Exception.h>
#include <ucontext.h>

#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define MESA_EMU_ASAN 1
#endif

namespace mesa_emu {
namespace {

constexpr size_t kStackBytes = 64 * 1024;
constexpr uint64_t kPoison = 0x7fc0dead7fc0deadull;  // a NaN in either half, -ish as an int

enum class State { kRunnable, kStopped, kExited };

}  // namespace

struct Fiber {
  ucontext_t context;
  std::unique_ptr<char[]> stack;
  uint3 index{};
  State state = State::kRunnable;
  Stop stop = Stop::kNone;
  unsigned mask = 0;
  uint64_t value = 0;
  int arg = 0;
  int width = 0;
  std::source_location where;
  uint64_t received = 0;
};

thread_local Fiber* current_fiber = nullptr;
thread_local uint3 current_block{};
thread_local dim3 current_block_dim;
thread_local dim3 current_grid_dim;

namespace {

std::mutex log_mutex;
std::vector<std::string> launches;
std::string last_error;
std::atomic<int64_t> poisoned{0};
std::mutex launch_mutex;  // one launch at a time, as on one stream

std::string site(const Fiber& f) {
  static const char* names[] = {"-", "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                                "__shfl_xor_sync", "__syncthreads"};
  std::ostringstream out;
  out << names[static_cast<int>(f.stop)] << " at " << f.where.file_name() << ":"
      << f.where.line();
  return out.str();
}

bool same_site(const Fiber& a, const Fiber& b) {
  return a.stop == b.stop && a.where.line() == b.where.line() &&
         std::strcmp(a.where.file_name(), b.where.file_name()) == 0 &&
         a.where.column() == b.where.column();
}

// One OS thread's block runner: the fibers of one block and the context they return to.
class BlockRunner {
 public:
  // Runs block `block` of the launch; returns an error message, empty on success.
  std::string run(const uint3& block, const dim3& block_dim, const dim3& grid_dim,
                  const std::function<void()>& body) {
    const size_t count = size_t{block_dim.x} * block_dim.y * block_dim.z;
    if (fibers_.size() < count) {
      fibers_.resize(count);
    }
    body_ = &body;
    current_block = block;
    current_block_dim = block_dim;
    current_grid_dim = grid_dim;
    for (size_t t = 0; t < count; ++t) {
      Fiber& f = fibers_[t];
      if (!f.stack) {
        f.stack.reset(new char[kStackBytes]);  // not zeroed: a thread's stack starts undefined
      }
      f.index = {static_cast<unsigned>(t % block_dim.x),
                 static_cast<unsigned>(t / block_dim.x % block_dim.y),
                 static_cast<unsigned>(t / (size_t{block_dim.x} * block_dim.y))};
      f.state = State::kRunnable;
      f.stop = Stop::kNone;
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = f.stack.get();
      f.context.uc_stack.ss_size = kStackBytes;
      f.context.uc_link = nullptr;
      makecontext(&f.context, &BlockRunner::entry, 0);
    }
    count_ = count;
    while (true) {
      for (size_t t = 0; t < count; ++t) {
        if (fibers_[t].state == State::kRunnable) {
          resume(fibers_[t]);
        }
      }
      bool live = false;
      for (size_t t = 0; t < count; ++t) {
        live = live || fibers_[t].state == State::kStopped;
      }
      if (!live) {
        return {};
      }
      std::string error = settle();
      if (!error.empty()) {
        std::ostringstream out;
        out << error << " (block " << block.x << "," << block.y << "," << block.z << ")";
        return out.str();
      }
    }
  }

  static thread_local BlockRunner* active;

  // Called by a fiber: stop here until the scheduler settles the stop.
  void yield(Fiber& f) {
#ifdef MESA_EMU_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, scheduler_stack_, scheduler_stack_size_);
    swapcontext(&f.context, &scheduler_);
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
    swapcontext(&f.context, &scheduler_);
#endif
  }

 private:
  static void entry() {
    BlockRunner* runner = active;
#ifdef MESA_EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &runner->scheduler_stack_,
                                    &runner->scheduler_stack_size_);
#endif
    (*runner->body_)();
    Fiber& f = *current_fiber;
    f.state = State::kExited;
#ifdef MESA_EMU_ASAN
    __sanitizer_start_switch_fiber(nullptr, runner->scheduler_stack_,
                                   runner->scheduler_stack_size_);
#endif
    setcontext(&runner->scheduler_);
  }

  void resume(Fiber& f) {
    current_fiber = &f;
    active = this;
#ifdef MESA_EMU_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, f.stack.get(), kStackBytes);
    swapcontext(&scheduler_, &f.context);
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
    swapcontext(&scheduler_, &f.context);
#endif
    current_fiber = nullptr;
  }

  // Every live fiber is stopped: settle the warps at shuffles, else release a barrier.
  std::string settle() {
    bool shuffled = false;
    for (size_t first = 0; first < count_; first += warpSize) {
      const size_t end = std::min(count_, first + warpSize);
      const Fiber* lead = nullptr;
      for (size_t t = first; t < end; ++t) {
        const Fiber& f = fibers_[t];
        if (f.state != State::kStopped) {
          continue;
        }
        if (lead == nullptr) {
          lead = &f;
        } else if (!same_site(*lead, f)) {
          std::ostringstream out;
          out << "divergence: lanes of warp " << first / warpSize << " stopped at " << site(*lead)
              << " and at " << site(f);
          return out.str();
        }
      }
      if (lead == nullptr || lead->stop == Stop::kSyncthreads) {
        continue;
      }
      std::string error = shuffle(first, end);
      if (!error.empty()) {
        return error;
      }
      shuffled = true;
    }
    if (shuffled) {
      return {};
    }
    // Only barriers are left: every thread of the block must be at the same one.
    const Fiber* lead = nullptr;
    for (size_t t = 0; t < count_; ++t) {
      const Fiber& f = fibers_[t];
      if (f.state == State::kStopped && lead == nullptr) {
        lead = &f;
      }
    }
    for (size_t t = 0; t < count_; ++t) {
      Fiber& f = fibers_[t];
      if (f.state == State::kExited || !same_site(*lead, f)) {
        std::ostringstream out;
        out << "deadlock: thread " << t << " never reaches " << site(*lead) << " ("
            << (f.state == State::kExited ? std::string("it exited") : "it waits at " + site(f))
            << ")";
        return out.str();
      }
    }
    for (size_t t = 0; t < count_; ++t) {
      fibers_[t].state = State::kRunnable;
    }
    return {};
  }

  std::string shuffle(size_t first, size_t end) {
    for (size_t t = first; t < end; ++t) {
      Fiber& f = fibers_[t];
      if (f.state != State::kStopped) {
        continue;
      }
      const int lane = static_cast<int>(t - first);
      const int width = f.width;
      if (width <= 0 || width > warpSize || (width & (width - 1)) != 0) {
        return "invalid shuffle width " + std::to_string(width) + " at " + site(f);
      }
      if (!(f.mask >> lane & 1u)) {
        return "lane " + std::to_string(lane) + " is not in its own mask at " + site(f);
      }
      if (fibers_[first].state == State::kStopped && f.mask != fibers_[first].mask) {
        return "lanes of one shuffle give different masks at " + site(f);
      }
      const int segment = lane / width * width;
      int source = lane;
      switch (f.stop) {
        case Stop::kShflIdx:
          source = segment + ((f.arg % width) + width) % width;
          break;
        case Stop::kShflUp:
          source = lane - segment >= f.arg ? lane - f.arg : lane;
          break;
        case Stop::kShflDown:
          source = lane - segment + f.arg < width ? lane + f.arg : lane;
          break;
        case Stop::kShflXor:
          source = lane ^ f.arg;
          source = source / width * width > segment ? lane : source;  // later segments: own
          break;
        default:
          break;
      }
      const size_t from = first + static_cast<size_t>(source);
      if (source < 0 || source >= warpSize || from >= end || !(f.mask >> source & 1u) ||
          fibers_[from].state != State::kStopped) {
        f.received = kPoison;
        poisoned.fetch_add(1);
      } else {
        f.received = fibers_[from].value;
      }
    }
    for (size_t t = first; t < end; ++t) {
      if (fibers_[t].state == State::kStopped) {
        fibers_[t].state = State::kRunnable;
      }
    }
    return {};
  }

  std::vector<Fiber> fibers_;
  size_t count_ = 0;
  const std::function<void()>* body_ = nullptr;
  ucontext_t scheduler_;
  const void* scheduler_stack_ = nullptr;
  size_t scheduler_stack_size_ = 0;
};

thread_local BlockRunner* BlockRunner::active = nullptr;

// One runner (fibers and their stacks) per worker slot, kept across launches: launches run one
// at a time, and worker w of every launch uses runner w.
BlockRunner& runner_for_worker(size_t worker) {
  static std::vector<std::unique_ptr<BlockRunner>> runners;
  while (runners.size() <= worker) {
    runners.push_back(std::make_unique<BlockRunner>());
  }
  return *runners[worker];
}

}  // namespace

const uint3& thread_index() {
  TORCH_CHECK(current_fiber != nullptr, "threadIdx outside a kernel");
  return current_fiber->index;
}

uint64_t stop_at(Stop kind, unsigned mask, uint64_t value, int arg, int width,
                 const std::source_location& where) {
  Fiber& f = *current_fiber;
  f.state = State::kStopped;
  f.stop = kind;
  f.mask = mask;
  f.value = value;
  f.arg = arg;
  f.width = width;
  f.where = where;
  BlockRunner::active->yield(f);
  // Resumed on the same OS thread: the runner and its thread-locals are this block's.
  f.stop = Stop::kNone;
  return f.received;
}

void run_grid(const char* name, const LaunchConfig& cfg, const std::function<void()>& body) {
  const std::lock_guard<std::mutex> lock(launch_mutex);
  {
    const std::lock_guard<std::mutex> log_lock(log_mutex);
    launches.emplace_back(name);
  }
  const dim3& g = cfg.grid;
  const dim3& b = cfg.block;
  const uint64_t threads = uint64_t{b.x} * b.y * b.z;
  if (g.x == 0 || g.y == 0 || g.z == 0 || threads == 0 || threads > 1024 || b.z > 64 ||
      g.y > 65535 || g.z > 65535 || g.x > 0x7fffffffu || cfg.shared_bytes > 48 * 1024) {
    std::ostringstream out;
    out << name << ": invalid configuration argument (grid " << g.x << "x" << g.y << "x" << g.z
        << ", block " << b.x << "x" << b.y << "x" << b.z << ")";
    last_error = out.str();
    return;
  }
  const uint64_t blocks = uint64_t{g.x} * g.y * g.z;
  std::atomic<uint64_t> next{0};
  std::mutex error_mutex;
  std::string error;
  std::atomic<bool> failed{false};
  const int workers = static_cast<int>(
      std::min<uint64_t>(blocks, static_cast<uint64_t>(std::max(1, settings().workers))));
  for (int w = 0; w < workers; ++w) {
    runner_for_worker(static_cast<size_t>(w));  // created here, not in the racing workers
  }
  auto work = [&](size_t worker) {
    BlockRunner& runner = runner_for_worker(worker);
    for (uint64_t i = next.fetch_add(1); i < blocks && !failed.load(); i = next.fetch_add(1)) {
      const uint3 block{static_cast<unsigned>(i % g.x), static_cast<unsigned>(i / g.x % g.y),
                        static_cast<unsigned>(i / (uint64_t{g.x} * g.y))};
      std::string message = runner.run(block, b, g, body);
      if (!message.empty()) {
        const std::lock_guard<std::mutex> error_lock(error_mutex);
        if (error.empty()) {
          error = std::string(name) + ": " + message;
        }
        failed.store(true);
      }
    }
  };
  std::vector<std::thread> pool;
  for (int w = 1; w < workers; ++w) {
    pool.emplace_back(work, static_cast<size_t>(w));
  }
  work(0);
  for (std::thread& t : pool) {
    t.join();
  }
  if (!error.empty()) {
    last_error = error;
  }
}

void record_operation(const char* name) {
  const std::lock_guard<std::mutex> log_lock(log_mutex);
  launches.emplace_back(name);
}

std::string take_error() {
  std::string error;
  std::swap(error, last_error);
  return error;
}

void check_last_launch() {
  const std::string error = take_error();
  TORCH_CHECK(error.empty(), "emulated CUDA launch failed: ", error);
}

Settings& settings() {
  static Settings instance;
  return instance;
}

std::vector<std::string> launch_log() {
  const std::lock_guard<std::mutex> log_lock(log_mutex);
  return launches;
}

void clear_launch_log() {
  const std::lock_guard<std::mutex> log_lock(log_mutex);
  launches.clear();
  poisoned.store(0);
}

int64_t poison_reads() {
  return poisoned.load();
}

}  // namespace mesa_emu

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int /*device*/) {
  if (attr != cudaDevAttrMultiProcessorCount) {
    return cudaErrorInvalidConfiguration;
  }
  *value = mesa_emu::settings().multiprocessors;
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t /*stream*/) {
  mesa_emu::record_operation("memset");
  std::memset(ptr, value, bytes);
  return cudaSuccess;
}

cudaError_t cudaGetLastError() {
  return mesa_emu::take_error().empty() ? cudaSuccess : cudaErrorLaunchFailure;
}

const char* cudaGetErrorString(cudaError_t error) {
  return error == cudaSuccess ? "no error" : "emulated CUDA error";
}
