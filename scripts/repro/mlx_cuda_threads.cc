// MLX 0.32.4 CUDA: four threads that take turns inside MLX under ONE mutex still abort.
//
// Every MLX call below is made while holding `m`, on one thread-unsafe stream per device that is
// every thread's default (what rmlx-sys does). No two threads are ever inside MLX at once, yet
// runs end in (measured on an H100, CUDA 13: 1 of 60 runs of this program; 32 of 120 runs of the
// rmlx test binary holding the same four-thread test, 12 of 30 with that test alone)
//   terminate called after throwing an instance of 'std::runtime_error'
//   what():  cudaStreamEndCapture(stream, &handle_) failed: operation failed due to a previous
//            error during capture
// With MLX_USE_CUDA_GRAPHS=0, rmlx's test ran clean 20 of 20 times. Without the mutex (each thread
// on its own default stream) a similar program aborted in 5 of 20 runs.
//
// Build (against any MLX 0.32.4 prefix; the binary runs against the CUDA libmlx.so):
//   g++ -O1 -std=c++20 -I$MLX/include mlx_cuda_threads.cc -L$MLX/lib -lmlx -Wl,-rpath,$MLX/lib -lpthread
// Run many times: for i in $(seq 50); do ./a.out 20 || echo "run $i failed"; done
#include "mlx/mlx.h"

#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace mx = mlx::core;

std::recursive_mutex m;

mx::Stream shared(mx::Device d) {
  static std::map<int, mx::Stream> streams;
  auto it = streams.find(static_cast<int>(d.type));
  if (it == streams.end()) it = streams.emplace(static_cast<int>(d.type), mx::new_thread_unsafe_stream(d)).first;
  return it->second;
}

void bind_thread_defaults() {
  static thread_local bool bound = false;
  if (bound) return;
  bound = true;
  mx::set_default_stream(shared(mx::Device::cpu));
  if (mx::is_available(mx::Device::gpu)) mx::set_default_stream(shared(mx::Device::gpu));
}

// Runs f with the lock held.
template <class F>
auto locked(F f) {
  std::lock_guard<std::recursive_mutex> guard(m);
  bind_thread_defaults();
  return f();
}

int main(int argc, char** argv) {
  int rounds = argc > 1 ? std::atoi(argv[1]) : 20;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; t++) {
    threads.emplace_back([=] {
      int n = 1000 + t * 100;
      for (int r = 0; r < rounds; r++) {
        auto sum = locked([&] {
          auto x = mx::arange(0.0, n, 1.0, mx::int64);
          auto y = mx::add(mx::multiply(x, mx::array(static_cast<int64_t>(t + 1))), mx::array(static_cast<int64_t>(r)));
          return std::make_unique<mx::array>(mx::sum(y, false));
        });
        long got = locked([&] { sum->eval(); return static_cast<long>(sum->item<int64_t>()); });
        locked([&] { sum.reset(); return 0; });
        long want = static_cast<long>(t + 1) * n * (n - 1) / 2 + static_cast<long>(r) * n;
        if (got != want) {
          std::fprintf(stderr, "thread %d round %d: %ld != %ld\n", t, r, got, want);
          return;
        }
        float d[4] = {static_cast<float>(t), 1, 2, 3};
        auto mm = locked([&] { auto a = mx::array(d, {2, 2}); return std::make_unique<mx::array>(mx::matmul(a, a)); });
        float out[4];
        locked([&] { mm->eval(); std::memcpy(out, mm->data<float>(), sizeof(out)); mm.reset(); return 0; });
      }
    });
  }
  for (auto& t : threads) t.join();
  std::printf("OK\n");
}
