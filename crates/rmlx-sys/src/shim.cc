// Implementations of the shim declared in shim.h. Each function converts its arguments, makes one
// MLX call and wraps the result; MLX's exceptions pass through to cxx untouched.
#include "rmlx-sys/src/lib.rs.h"

#include "mlx/primitives.h"
#include "mlx/scheduler.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <dlfcn.h>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <unordered_set>
#include <vector>

namespace mx = mlx::core;

namespace rmlx_shim {
namespace {

const mx::Dtype kDtypes[] = {
    mx::bool_,   mx::uint8,   mx::uint16,  mx::uint32,  mx::uint64,
    mx::int8,    mx::int16,   mx::int32,   mx::int64,   mx::float16,
    mx::float32, mx::float64, mx::bfloat16, mx::complex64};

mx::Dtype dt(uint8_t code) {
  if (code >= sizeof(kDtypes) / sizeof(kDtypes[0])) {
    throw std::invalid_argument("[rmlx] unknown dtype code " + std::to_string(code));
  }
  return kDtypes[code];
}

uint8_t code_of(mx::Dtype d) { return static_cast<uint8_t>(d.val()); }

mx::Device device_of(uint8_t type, int32_t index) {
  return mx::Device(type == 0 ? mx::Device::cpu : mx::Device::gpu, index);
}

// ---- draining the streams at exit ----------------------------------------------------------------
//
// MLX deliberately leaks its scheduler, so its stream threads keep running while the process exits.
// Work still queued or running on them then (a decode step queued by `async_eval` that nobody waits
// for) races with the destructors of the libraries it calls: OpenBLAS's `gotoblas_quit` frees its
// buffers and shuts down its thread pool under a running sgemm, which shows up as heap corruption
// ("corrupted double-linked list"), SIGSEGV, or a hang in `blas_thread_shutdown_` when its worker
// overwrites the shutdown request after finishing the job. So every CPU stream rmlx hands out is
// recorded, and an `atexit` handler (which runs before any library destructor) waits, for at most
// ten seconds, until these and every other CPU stream MLX knows of are idle. The records are leaked
// on purpose: they must outlive static destruction. GPU streams are left alone: the CUDA runtime
// tears itself down from its own `atexit` handler, which may run before this one, and
// synchronising a stream after that hangs.
std::mutex& live_streams_mutex() {
  static auto* m = new std::mutex;
  return *m;
}

std::vector<mx::Stream>& live_streams() {
  static auto* v = new std::vector<mx::Stream>;
  return *v;
}

void drain_streams_at_exit() {
  std::vector<mx::Stream> streams;
  {
    std::lock_guard<std::mutex> guard(live_streams_mutex());
    streams = live_streams();
  }
  // Also the streams MLX made by itself (a thread's default stream, created before rmlx bound its
  // own): work may be queued there too.
  for (auto& s : mx::get_streams()) {
    if (s.device.type == mx::Device::cpu &&
        std::find(streams.begin(), streams.end(), s) == streams.end()) {
      streams.push_back(s);
    }
  }
  // Waited for on a helper thread, for a bounded time: a CPU task waiting on a GPU event that the
  // GPU runtime's own exit handler orphaned must not turn exit into a hang.
  struct Done {
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
  };
  auto done = std::make_shared<Done>();
  std::thread([streams = std::move(streams), done] {
    for (auto& s : streams) {
      try {
        mx::synchronize(s);
      } catch (...) {
        // An error stored on the stream is of no use any more; the point is that it is idle.
      }
    }
    std::lock_guard<std::mutex> guard(done->m);
    done->done = true;
    done->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(done->m);
  done->cv.wait_for(lock, std::chrono::seconds(10), [&] { return done->done; });
}

// Registers the exit handler. `atexit` handlers and the destructors of function-local statics run
// in the reverse order of their registration, so MLX's statics that queued work uses are created
// first: its allocator (the CPU build's buffer cache is such a static, and was torn down under
// running ops when the handler came first).
void register_drain() {
  mx::allocator::allocator();
  std::atexit(drain_streams_at_exit);
}

// Records a CPU stream so that the process waits for it at exit; returns it.
mx::Stream track(mx::Stream s) {
  if (s.device.type != mx::Device::cpu) return s;
  std::lock_guard<std::mutex> guard(live_streams_mutex());
  static bool registered = (register_drain(), true);
  (void)registered;
  live_streams().push_back(s);
  return s;
}

// rmlx runs all of its work on one stream per device, shared by every thread (MLX's own default
// streams are per thread). The safe layer serialises calls into MLX, which such a stream requires;
// in exchange a graph built on one thread can be evaluated on any other, and MLX's CUDA backend
// never sees two threads capturing CUDA graphs at once.
mx::Stream shared_stream(mx::Device d) {
  auto key = std::make_pair(static_cast<int>(d.type), d.index);
  // Each thread keeps a copy of the few (device -> stream) entries it has used: no lock per op.
  thread_local std::map<std::pair<int, int>, mx::Stream> seen;
  if (auto hit = seen.find(key); hit != seen.end()) return hit->second;
  static std::mutex mutex;
  static std::map<std::pair<int, int>, mx::Stream> streams;
  std::lock_guard<std::mutex> guard(mutex);
  auto it = streams.find(key);
  if (it == streams.end()) it = streams.emplace(key, track(mx::new_thread_unsafe_stream(d))).first;
  seen.emplace(key, it->second);
  return it->second;
}

// Makes the shared streams this thread's defaults too, so that MLX's internal uses of the default
// stream (the global random key, say) land on them as well. Once per thread.
void bind_thread_defaults() {
  static thread_local bool bound = false;
  if (bound) return;
  bound = true;
  mx::set_default_stream(shared_stream(mx::Device(mx::Device::cpu)));
  if (mx::is_available(mx::Device(mx::Device::gpu))) {
    mx::set_default_stream(shared_stream(mx::Device(mx::Device::gpu)));
  }
}

mx::StreamOrDevice sod(StreamSpec s) {
  bind_thread_defaults();
  switch (s.kind) {
    case 1: return shared_stream(device_of(s.device_type, s.device_index));
    case 2: return mx::Stream(s.stream_index, device_of(s.device_type, s.device_index));
    default: return shared_stream(mx::default_device());
  }
}

StreamSpec spec_of(const mx::Stream& st) {
  return StreamSpec{2, static_cast<uint8_t>(st.device.type == mx::Device::cpu ? 0 : 1),
                    st.device.index, st.index};
}

// MLX's GPU backends have no float64 kernels; the CUDA backend only finds out while it evaluates,
// inside CUDA-graph capture, and the failed capture can bring down a later evaluation
// (`std::terminate`). So an op recorded on a GPU stream that takes or makes float64 is refused here,
// when it is built, before anything reaches the device.
void check_gpu_dtypes(const mx::array& a) {
  if (!a.has_primitive() || a.primitive().stream().device.type != mx::Device::gpu) return;
  bool f64 = a.dtype() == mx::float64;
  for (auto& in : a.inputs()) f64 = f64 || in.dtype() == mx::float64;
  if (f64) {
    throw std::invalid_argument(
        "[rmlx] float64 is not supported on the GPU (" + std::string(a.primitive().name()) +
        "): use float32, or run the op on the CPU (rmlx::with_device(Device::cpu(), ...))");
  }
}

ArrayPtr wrap(mx::array a) {
  check_gpu_dtypes(a);
  return std::make_unique<mx::array>(std::move(a));
}

VecPtr wrap_vec(std::vector<mx::array> v) {
  for (auto& a : v) check_gpu_dtypes(a);
  return std::make_unique<ArrayVec>(std::move(v));
}

mx::Shape shape_of(Shape s) { return mx::Shape(s.begin(), s.end()); }

std::vector<int> ints(rust::Slice<const int32_t> s) { return std::vector<int>(s.begin(), s.end()); }

std::optional<mx::array> opt(const Array* a) {
  return a ? std::optional<mx::array>(*a) : std::nullopt;
}

std::optional<int> opt_int(int32_t v) { return v > 0 ? std::optional<int>(v) : std::nullopt; }

std::string str(rust::Str s) { return std::string(s.data(), s.size()); }

template <typename T>
mx::array from_typed(const uint8_t* data, mx::Shape shape, mx::Dtype d) {
  return mx::array(reinterpret_cast<const T*>(data), std::move(shape), d);
}

NamedArrays named(std::unordered_map<std::string, mx::array> arrays) {
  NamedArrays out{{}, vec_new(), {}, {}, {}, vec_new()};
  std::vector<std::string> keys;
  for (auto& kv : arrays) keys.push_back(kv.first);
  std::sort(keys.begin(), keys.end());
  for (auto& k : keys) {
    out.names.push_back(rust::String(k));
    out.arrays->push_back(arrays.at(k));
  }
  return out;
}

}  // namespace

namespace detail {
mx::Dtype dtype_of_code(uint8_t code) { return dt(code); }
uint8_t code_of_dtype(mx::Dtype d) { return code_of(d); }
mx::StreamOrDevice stream_of(const StreamSpec& s) { return sod(s); }
void bind_thread() { bind_thread_defaults(); }
}  // namespace detail

// ---- version, devices, streams --------------------------------------------------------------------

rust::String mlx_version() { return rust::String(mx::version()); }

StreamSpec default_device() {
  auto d = mx::default_device();
  return StreamSpec{1, static_cast<uint8_t>(d.type == mx::Device::cpu ? 0 : 1), d.index, 0};
}

void set_default_device(uint8_t device_type, int32_t index) {
  mx::set_default_device(device_of(device_type, index));
}

bool is_available(uint8_t device_type, int32_t index) {
  return mx::is_available(device_of(device_type, index));
}

int32_t device_count(uint8_t device_type) {
  return mx::device_count(device_type == 0 ? mx::Device::cpu : mx::Device::gpu);
}

rust::Vec<rust::String> device_info(uint8_t device_type, int32_t index) {
  rust::Vec<rust::String> out;
  for (auto& [key, value] : mx::device_info(device_of(device_type, index))) {
    out.push_back(rust::String(key));
    if (auto* s = std::get_if<std::string>(&value)) {
      out.push_back(rust::String(*s));
    } else {
      out.push_back(rust::String(std::to_string(std::get<size_t>(value))));
    }
  }
  return out;
}

StreamSpec default_stream(uint8_t device_type, int32_t index) {
  return spec_of(shared_stream(device_of(device_type, index)));
}

StreamSpec new_stream(uint8_t device_type, int32_t index) {
  return spec_of(track(mx::new_thread_unsafe_stream(device_of(device_type, index))));
}

void synchronize(StreamSpec s) {
  mx::synchronize(std::get<mx::Stream>(sod(s)));
}

void init_runtime() {
  // The scheduler records the thread that creates it as MLX's main thread, and creates the GPU
  // backend's per-thread state (event pool, cuBLAS and cuDNN handle caches) on it.
  mx::scheduler::scheduler();
  bind_thread_defaults();
}

// rmlx-sys's `mlx-cpu` install forwards BLAS to OpenBLAS built with the `scipy_` symbol prefix;
// another OpenBLAS may be the plain one. Looked up at run time: a libmlx without OpenBLAS is fine.
int32_t blas_threads(int32_t threads) {
  using Set = void (*)(int);
  using Get = int (*)();
  static const auto set = [] {
    void* f = dlsym(RTLD_DEFAULT, "scipy_openblas_set_num_threads");
    return reinterpret_cast<Set>(f ? f : dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  }();
  static const auto get = [] {
    void* f = dlsym(RTLD_DEFAULT, "scipy_openblas_get_num_threads");
    return reinterpret_cast<Get>(f ? f : dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  }();
  if (!set || !get) return 0;
  if (threads > 0) set(threads);
  return get();
}

// ---- array basics -----------------------------------------------------------------------------------

ArrayPtr array_from_data(rust::Slice<const uint8_t> data, Shape shape, uint8_t dtype) {
  auto d = dt(dtype);
  auto sh = shape_of(shape);
  size_t n = 1;
  for (auto v : sh) {
    if (v < 0) throw std::invalid_argument("[array] negative dimension in shape");
    n *= static_cast<size_t>(v);
  }
  if (n * d.size() != data.size()) {
    std::ostringstream msg;
    msg << "[array] data has " << data.size() << " bytes but shape " << sh << " of " << d
        << " needs " << n * d.size();
    throw std::invalid_argument(msg.str());
  }
  const uint8_t* p = data.data();
  switch (d.val()) {
    case mx::Dtype::Val::bool_: return wrap(from_typed<bool>(p, sh, d));
    case mx::Dtype::Val::uint8: return wrap(from_typed<uint8_t>(p, sh, d));
    case mx::Dtype::Val::uint16: return wrap(from_typed<uint16_t>(p, sh, d));
    case mx::Dtype::Val::uint32: return wrap(from_typed<uint32_t>(p, sh, d));
    case mx::Dtype::Val::uint64: return wrap(from_typed<uint64_t>(p, sh, d));
    case mx::Dtype::Val::int8: return wrap(from_typed<int8_t>(p, sh, d));
    case mx::Dtype::Val::int16: return wrap(from_typed<int16_t>(p, sh, d));
    case mx::Dtype::Val::int32: return wrap(from_typed<int32_t>(p, sh, d));
    case mx::Dtype::Val::int64: return wrap(from_typed<int64_t>(p, sh, d));
    case mx::Dtype::Val::float16: return wrap(from_typed<mx::float16_t>(p, sh, d));
    case mx::Dtype::Val::float32: return wrap(from_typed<float>(p, sh, d));
    case mx::Dtype::Val::float64: return wrap(from_typed<double>(p, sh, d));
    case mx::Dtype::Val::bfloat16: return wrap(from_typed<mx::bfloat16_t>(p, sh, d));
    case mx::Dtype::Val::complex64: return wrap(from_typed<mx::complex64_t>(p, sh, d));
  }
  throw std::invalid_argument("[array] unsupported dtype");
}

ArrayPtr array_from_f64(double value, uint8_t dtype) { return wrap(mx::array(value, dt(dtype))); }
ArrayPtr array_from_i64(int64_t value, uint8_t dtype) { return wrap(mx::array(value, dt(dtype))); }
ArrayPtr array_from_bool(bool value) { return wrap(mx::array(value)); }
ArrayPtr array_from_complex(float re, float im) {
  return wrap(mx::array(std::complex<float>(re, im)));
}
ArrayPtr array_clone(const Array& a) { return wrap(a); }

rust::Slice<const int32_t> array_shape(const Array& a) {
  return rust::Slice<const int32_t>(a.shape().data(), a.shape().size());
}
rust::Slice<const int64_t> array_strides(const Array& a) {
  return rust::Slice<const int64_t>(a.strides().data(), a.strides().size());
}
uint8_t array_dtype(const Array& a) { return code_of(a.dtype()); }
size_t array_size(const Array& a) { return a.size(); }
size_t array_nbytes(const Array& a) { return a.nbytes(); }
size_t array_itemsize(const Array& a) { return a.itemsize(); }
size_t array_id(const Array& a) { return a.id(); }
bool array_is_evaluated(const Array& a) { return a.status() != mx::array::Status::unscheduled; }
bool array_row_contiguous(const Array& a) { return a.is_available() && a.flags().row_contiguous; }

void array_copy_to(const Array& a, rust::Slice<uint8_t> out) {
  if (out.size() != a.nbytes()) {
    throw std::invalid_argument("[rmlx] output buffer has " + std::to_string(out.size()) +
                                " bytes, the array " + std::to_string(a.nbytes()));
  }
  bind_thread_defaults();
  // A copy, if one is needed, runs where the array was computed (taken before evaluation, which
  // detaches the array from its graph).
  mx::Stream stream = a.has_primitive() ? a.primitive().stream() : shared_stream(mx::default_device());
  mx::array c = a;
  c.eval();
  if (!c.flags().row_contiguous) {
    c = mx::contiguous(c, false, stream);
    c.eval();
  }
  if (c.nbytes() > 0) std::memcpy(out.data(), c.data<uint8_t>(), c.nbytes());
}

bool array_wait(const Array& a) {
  if (a.status() == mx::array::Status::unscheduled) return false;
  const_cast<Array&>(a).wait();
  return true;
}

bool array_copy_ready(const Array& a, rust::Slice<uint8_t> out) {
  if (out.size() != a.nbytes()) {
    throw std::invalid_argument("[rmlx] output buffer has " + std::to_string(out.size()) +
                                " bytes, the array " + std::to_string(a.nbytes()));
  }
  if (!array_wait(a) || !a.flags().row_contiguous) return false;
  if (a.nbytes() > 0) std::memcpy(out.data(), a.data<uint8_t>(), a.nbytes());
  return true;
}

rust::String array_to_string(const Array& a) {
  bind_thread_defaults();
  std::ostringstream os;
  os << a;
  return rust::String(os.str());
}

void array_eval(const Array& a) {
  bind_thread_defaults();
  const_cast<Array&>(a).eval();
}
uint8_t result_type(const Array& a, const Array& b) { return code_of(mx::result_type(a, b)); }

VecPtr vec_new() { return std::make_unique<ArrayVec>(); }
void vec_push(ArrayVec& v, const Array& a) { v.push_back(a); }
size_t vec_len(const ArrayVec& v) { return v.size(); }
ArrayPtr vec_get(const ArrayVec& v, size_t i) { return wrap(v.at(i)); }
void eval(const ArrayVec& v) {
  bind_thread_defaults();
  mx::eval(v);
}
void async_eval(const ArrayVec& v) {
  bind_thread_defaults();
  mx::async_eval(v);
  // Work may now outlive the caller's interest in it: register the exit handler once more, after
  // every static that evaluation creates lazily exists (draining twice is harmless).
  static bool registered = (std::atexit(drain_streams_at_exit), true);
  (void)registered;
}

// ---- creation -----------------------------------------------------------------------------------------

ArrayPtr zeros(Shape shape, uint8_t dtype, StreamSpec s) { return wrap(mx::zeros(shape_of(shape), dt(dtype), sod(s))); }
ArrayPtr ones(Shape shape, uint8_t dtype, StreamSpec s) { return wrap(mx::ones(shape_of(shape), dt(dtype), sod(s))); }
ArrayPtr full(Shape shape, const Array& value, uint8_t dtype, StreamSpec s) {
  return wrap(mx::full(shape_of(shape), value, dt(dtype), sod(s)));
}
ArrayPtr arange(double start, double stop, double step, uint8_t dtype, StreamSpec s) {
  return wrap(mx::arange(start, stop, step, dt(dtype), sod(s)));
}
ArrayPtr linspace(double start, double stop, int32_t num, uint8_t dtype, StreamSpec s) {
  return wrap(mx::linspace(start, stop, num, dt(dtype), sod(s)));
}
ArrayPtr eye(int32_t n, int32_t m, int32_t k, uint8_t dtype, StreamSpec s) { return wrap(mx::eye(n, m, k, dt(dtype), sod(s))); }
ArrayPtr tri(int32_t n, int32_t m, int32_t k, uint8_t dtype, StreamSpec s) { return wrap(mx::tri(n, m, k, dt(dtype), sod(s))); }

// ---- element-wise -------------------------------------------------------------------------------------

ArrayPtr unary(UnaryOp op, const Array& a, StreamSpec st) {
  auto s = sod(st);
  switch (op) {
    case UnaryOp::Abs: return wrap(mx::abs(a, s));
    case UnaryOp::Negative: return wrap(mx::negative(a, s));
    case UnaryOp::Sign: return wrap(mx::sign(a, s));
    case UnaryOp::Exp: return wrap(mx::exp(a, s));
    case UnaryOp::Expm1: return wrap(mx::expm1(a, s));
    case UnaryOp::Log: return wrap(mx::log(a, s));
    case UnaryOp::Log1p: return wrap(mx::log1p(a, s));
    case UnaryOp::Log2: return wrap(mx::log2(a, s));
    case UnaryOp::Log10: return wrap(mx::log10(a, s));
    case UnaryOp::Sqrt: return wrap(mx::sqrt(a, s));
    case UnaryOp::Rsqrt: return wrap(mx::rsqrt(a, s));
    case UnaryOp::Square: return wrap(mx::square(a, s));
    case UnaryOp::Reciprocal: return wrap(mx::reciprocal(a, s));
    case UnaryOp::Sin: return wrap(mx::sin(a, s));
    case UnaryOp::Cos: return wrap(mx::cos(a, s));
    case UnaryOp::Tan: return wrap(mx::tan(a, s));
    case UnaryOp::Arcsin: return wrap(mx::arcsin(a, s));
    case UnaryOp::Arccos: return wrap(mx::arccos(a, s));
    case UnaryOp::Arctan: return wrap(mx::arctan(a, s));
    case UnaryOp::Sinh: return wrap(mx::sinh(a, s));
    case UnaryOp::Cosh: return wrap(mx::cosh(a, s));
    case UnaryOp::Tanh: return wrap(mx::tanh(a, s));
    case UnaryOp::Arcsinh: return wrap(mx::arcsinh(a, s));
    case UnaryOp::Arccosh: return wrap(mx::arccosh(a, s));
    case UnaryOp::Arctanh: return wrap(mx::arctanh(a, s));
    case UnaryOp::Sigmoid: return wrap(mx::sigmoid(a, s));
    case UnaryOp::Erf: return wrap(mx::erf(a, s));
    case UnaryOp::Erfinv: return wrap(mx::erfinv(a, s));
    case UnaryOp::Floor: return wrap(mx::floor(a, s));
    case UnaryOp::Ceil: return wrap(mx::ceil(a, s));
    case UnaryOp::LogicalNot: return wrap(mx::logical_not(a, s));
    case UnaryOp::BitwiseInvert: return wrap(mx::bitwise_invert(a, s));
    case UnaryOp::IsNan: return wrap(mx::isnan(a, s));
    case UnaryOp::IsInf: return wrap(mx::isinf(a, s));
    case UnaryOp::IsFinite: return wrap(mx::isfinite(a, s));
    case UnaryOp::StopGradient: return wrap(mx::stop_gradient(a, s));
    case UnaryOp::Real: return wrap(mx::real(a, s));
    case UnaryOp::Imag: return wrap(mx::imag(a, s));
    case UnaryOp::Conjugate: return wrap(mx::conjugate(a, s));
    case UnaryOp::Degrees: return wrap(mx::degrees(a, s));
    case UnaryOp::Radians: return wrap(mx::radians(a, s));
  }
  throw std::invalid_argument("[rmlx] unknown unary op");
}

ArrayPtr binary(BinaryOp op, const Array& a, const Array& b, StreamSpec st) {
  auto s = sod(st);
  switch (op) {
    case BinaryOp::Add: return wrap(mx::add(a, b, s));
    case BinaryOp::Subtract: return wrap(mx::subtract(a, b, s));
    case BinaryOp::Multiply: return wrap(mx::multiply(a, b, s));
    case BinaryOp::Divide: return wrap(mx::divide(a, b, s));
    case BinaryOp::FloorDivide: return wrap(mx::floor_divide(a, b, s));
    case BinaryOp::Remainder: return wrap(mx::remainder(a, b, s));
    case BinaryOp::Power: return wrap(mx::power(a, b, s));
    case BinaryOp::Maximum: return wrap(mx::maximum(a, b, s));
    case BinaryOp::Minimum: return wrap(mx::minimum(a, b, s));
    case BinaryOp::Equal: return wrap(mx::equal(a, b, s));
    case BinaryOp::NotEqual: return wrap(mx::not_equal(a, b, s));
    case BinaryOp::Less: return wrap(mx::less(a, b, s));
    case BinaryOp::LessEqual: return wrap(mx::less_equal(a, b, s));
    case BinaryOp::Greater: return wrap(mx::greater(a, b, s));
    case BinaryOp::GreaterEqual: return wrap(mx::greater_equal(a, b, s));
    case BinaryOp::LogicalAnd: return wrap(mx::logical_and(a, b, s));
    case BinaryOp::LogicalOr: return wrap(mx::logical_or(a, b, s));
    case BinaryOp::BitwiseAnd: return wrap(mx::bitwise_and(a, b, s));
    case BinaryOp::BitwiseOr: return wrap(mx::bitwise_or(a, b, s));
    case BinaryOp::BitwiseXor: return wrap(mx::bitwise_xor(a, b, s));
    case BinaryOp::LeftShift: return wrap(mx::left_shift(a, b, s));
    case BinaryOp::RightShift: return wrap(mx::right_shift(a, b, s));
    case BinaryOp::Arctan2: return wrap(mx::arctan2(a, b, s));
    case BinaryOp::LogAddExp: return wrap(mx::logaddexp(a, b, s));
    case BinaryOp::Matmul: return wrap(mx::matmul(a, b, s));
    case BinaryOp::Outer: return wrap(mx::outer(a, b, s));
    case BinaryOp::Inner: return wrap(mx::inner(a, b, s));
  }
  throw std::invalid_argument("[rmlx] unknown binary op");
}

ArrayPtr round(const Array& a, int32_t decimals, StreamSpec s) { return wrap(mx::round(a, decimals, sod(s))); }
ArrayPtr where_(const Array& cond, const Array& x, const Array& y, StreamSpec s) { return wrap(mx::where(cond, x, y, sod(s))); }
ArrayPtr clip(const Array& a, const Array* lo, const Array* hi, StreamSpec s) { return wrap(mx::clip(a, opt(lo), opt(hi), sod(s))); }
ArrayPtr astype(const Array& a, uint8_t dtype, StreamSpec s) { return wrap(mx::astype(a, dt(dtype), sod(s))); }
ArrayPtr view(const Array& a, uint8_t dtype, StreamSpec s) { return wrap(mx::view(a, dt(dtype), sod(s))); }
ArrayPtr isclose(const Array& a, const Array& b, double rtol, double atol, bool equal_nan, StreamSpec s) {
  return wrap(mx::isclose(a, b, rtol, atol, equal_nan, sod(s)));
}
ArrayPtr array_equal(const Array& a, const Array& b, bool equal_nan, StreamSpec s) {
  return wrap(mx::array_equal(a, b, equal_nan, sod(s)));
}

// ---- reductions ---------------------------------------------------------------------------------------

ArrayPtr reduce(ReduceOp op, const Array& a, rust::Slice<const int32_t> axes_, bool all_axes, bool keepdims, StreamSpec st) {
  auto s = sod(st);
  std::vector<int> axes = all_axes ? std::vector<int>() : ints(axes_);
  if (all_axes) for (int i = 0; i < static_cast<int>(a.ndim()); ++i) axes.push_back(i);
  switch (op) {
    case ReduceOp::Sum: return wrap(mx::sum(a, axes, keepdims, s));
    case ReduceOp::Mean: return wrap(mx::mean(a, axes, keepdims, s));
    case ReduceOp::Prod: return wrap(mx::prod(a, axes, keepdims, s));
    case ReduceOp::Max: return wrap(mx::max(a, axes, keepdims, s));
    case ReduceOp::Min: return wrap(mx::min(a, axes, keepdims, s));
    case ReduceOp::All: return wrap(mx::all(a, axes, keepdims, s));
    case ReduceOp::Any: return wrap(mx::any(a, axes, keepdims, s));
    case ReduceOp::LogSumExp: return wrap(mx::logsumexp(a, axes, keepdims, s));
  }
  throw std::invalid_argument("[rmlx] unknown reduction");
}

ArrayPtr argmax(const Array& a, int32_t axis, bool all_axes, bool keepdims, StreamSpec s) {
  return wrap(all_axes ? mx::argmax(a, keepdims, sod(s)) : mx::argmax(a, axis, keepdims, sod(s)));
}
ArrayPtr argmin(const Array& a, int32_t axis, bool all_axes, bool keepdims, StreamSpec s) {
  return wrap(all_axes ? mx::argmin(a, keepdims, sod(s)) : mx::argmin(a, axis, keepdims, sod(s)));
}
ArrayPtr var(const Array& a, rust::Slice<const int32_t> axes, bool all_axes, bool keepdims, int32_t ddof, StreamSpec s) {
  return wrap(all_axes ? mx::var(a, keepdims, ddof, sod(s)) : mx::var(a, ints(axes), keepdims, ddof, sod(s)));
}
ArrayPtr std(const Array& a, rust::Slice<const int32_t> axes, bool all_axes, bool keepdims, int32_t ddof, StreamSpec s) {
  return wrap(all_axes ? mx::std(a, keepdims, ddof, sod(s)) : mx::std(a, ints(axes), keepdims, ddof, sod(s)));
}
ArrayPtr softmax(const Array& a, rust::Slice<const int32_t> axes, bool all_axes, bool precise, StreamSpec s) {
  return wrap(all_axes ? mx::softmax(a, precise, sod(s)) : mx::softmax(a, ints(axes), precise, sod(s)));
}

ArrayPtr scan(ScanOp op, const Array& a_, int32_t axis, bool all_axes, bool reverse, bool inclusive, StreamSpec st) {
  auto s = sod(st);
  mx::array a = all_axes ? mx::flatten(a_, s) : a_;
  int ax = all_axes ? 0 : axis;
  switch (op) {
    case ScanOp::Cumsum: return wrap(mx::cumsum(a, ax, reverse, inclusive, s));
    case ScanOp::Cumprod: return wrap(mx::cumprod(a, ax, reverse, inclusive, s));
    case ScanOp::Cummax: return wrap(mx::cummax(a, ax, reverse, inclusive, s));
    case ScanOp::Cummin: return wrap(mx::cummin(a, ax, reverse, inclusive, s));
    case ScanOp::LogCumSumExp: return wrap(mx::logcumsumexp(a, ax, reverse, inclusive, s));
  }
  throw std::invalid_argument("[rmlx] unknown scan");
}

// ---- linear algebra -----------------------------------------------------------------------------------

ArrayPtr addmm(const Array& c, const Array& a, const Array& b, float alpha, float beta, StreamSpec s) {
  return wrap(mx::addmm(c, a, b, alpha, beta, sod(s)));
}
ArrayPtr gather_mm(const Array& a, const Array& b, const Array* lhs_indices, const Array* rhs_indices,
                   bool sorted_indices, StreamSpec s) {
  return wrap(mx::gather_mm(a, b, opt(lhs_indices), opt(rhs_indices), sorted_indices, sod(s)));
}
ArrayPtr einsum(rust::Str subscripts, const ArrayVec& operands, StreamSpec s) {
  return wrap(mx::einsum(str(subscripts), operands, sod(s)));
}
ArrayPtr tensordot(const Array& a, const Array& b, rust::Slice<const int32_t> axes_a, rust::Slice<const int32_t> axes_b, StreamSpec s) {
  return wrap(mx::tensordot(a, b, ints(axes_a), ints(axes_b), sod(s)));
}

// ---- shapes -------------------------------------------------------------------------------------------

ArrayPtr reshape(const Array& a, Shape shape, StreamSpec s) { return wrap(mx::reshape(a, shape_of(shape), sod(s))); }
ArrayPtr transpose(const Array& a, rust::Slice<const int32_t> axes, bool all_axes, StreamSpec s) {
  return wrap(all_axes ? mx::transpose(a, sod(s)) : mx::transpose(a, ints(axes), sod(s)));
}
ArrayPtr swapaxes(const Array& a, int32_t axis1, int32_t axis2, StreamSpec s) { return wrap(mx::swapaxes(a, axis1, axis2, sod(s))); }
ArrayPtr moveaxis(const Array& a, int32_t source, int32_t destination, StreamSpec s) {
  return wrap(mx::moveaxis(a, source, destination, sod(s)));
}
ArrayPtr expand_dims(const Array& a, rust::Slice<const int32_t> axes, StreamSpec s) { return wrap(mx::expand_dims(a, ints(axes), sod(s))); }
ArrayPtr squeeze(const Array& a, rust::Slice<const int32_t> axes, bool all_axes, StreamSpec s) {
  return wrap(all_axes ? mx::squeeze(a, sod(s)) : mx::squeeze(a, ints(axes), sod(s)));
}
ArrayPtr flatten(const Array& a, int32_t start_axis, int32_t end_axis, StreamSpec s) {
  return wrap(mx::flatten(a, start_axis, end_axis, sod(s)));
}
ArrayPtr unflatten(const Array& a, int32_t axis, Shape shape, StreamSpec s) { return wrap(mx::unflatten(a, axis, shape_of(shape), sod(s))); }
ArrayPtr broadcast_to(const Array& a, Shape shape, StreamSpec s) { return wrap(mx::broadcast_to(a, shape_of(shape), sod(s))); }
ArrayPtr concatenate(const ArrayVec& arrays, int32_t axis, StreamSpec s) { return wrap(mx::concatenate(arrays, axis, sod(s))); }
ArrayPtr stack(const ArrayVec& arrays, int32_t axis, StreamSpec s) { return wrap(mx::stack(arrays, axis, sod(s))); }
VecPtr split_sections(const Array& a, int32_t num, int32_t axis, StreamSpec s) { return wrap_vec(mx::split(a, num, axis, sod(s))); }
// The operations still to run to produce `outputs`, counted by primitive: one `name count` line
// each (a multi-output operation counts once).
rust::String graph_census(const ArrayVec& outputs) {
  std::map<std::string, size_t> counts;
  std::unordered_set<std::uintptr_t> seen;
  std::vector<mx::array> stack(outputs.begin(), outputs.end());
  while (!stack.empty()) {
    mx::array a = stack.back();
    stack.pop_back();
    if (!a.has_primitive() || a.is_available()) continue;
    // One operation per group of sibling outputs (a compiled function's replays share one
    // primitive object, so the primitive is no identity).
    std::uintptr_t id = a.id();
    for (auto& s : a.siblings()) id = std::min(id, s.id());
    if (!seen.insert(id).second) continue;
    counts[a.primitive().name()]++;
    for (auto& i : a.inputs()) stack.push_back(i);
  }
  std::string out;
  for (auto& [name, n] : counts) out += name + " " + std::to_string(n) + "\n";
  return rust::String(out);
}
// A hash of the graph still to run to produce `outputs`: each operation in depth-first order from
// the outputs (inputs in their order), hashed with its primitive's name, its outputs' shapes and
// dtypes and where its inputs come from (an earlier operation by its number, or an evaluated array
// by its number, shape and dtype). MLX's evaluation orders the operations from nothing but this
// structure (the outputs in order, each operation's inputs in order), and its CUDA backend caches
// each CUDA graph it builds under a key of the operations in that order: evaluations with the same
// signature reuse the same CUDA graphs, where the same operations in another order make new ones.
uint64_t graph_signature(const ArrayVec& outputs) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; i++) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  auto mix_str = [&](const std::string& s) {
    for (unsigned char c : s) mix(c);
    mix(0xff);
  };
  auto mix_layout = [&](const mx::array& a) {
    for (auto d : a.shape()) mix(static_cast<uint64_t>(d));
    mix(static_cast<uint64_t>(a.dtype().val()) | (uint64_t(a.ndim()) << 16));
  };
  // Number of each operation (by its sibling group) and each evaluated array, in first-visit order.
  std::unordered_map<std::uintptr_t, uint64_t> numbers;
  auto group_of = [](const mx::array& a) {
    std::uintptr_t id = a.id();
    for (auto& s : a.siblings()) id = std::min(id, s.id());
    return id;
  };
  std::vector<std::pair<mx::array, size_t>> stack;
  auto reference = [&](const mx::array& a) {
    bool pending = a.has_primitive() && !a.is_available();
    std::uintptr_t key = pending ? group_of(a) : a.id();
    // Which output of its operation the input is.
    uint64_t position = pending ? static_cast<uint64_t>(a.sibling_position()) : 0;
    auto it = numbers.find(key);
    if (it != numbers.end()) {
      mix(it->second);
      mix(position);
      return false;
    }
    uint64_t n = numbers.size();
    numbers.emplace(key, n);
    mix(n);
    mix(position);
    if (!pending) {
      mix_layout(a);
      return false;
    }
    return true;
  };
  for (auto& o : outputs) {
    if (reference(o)) stack.emplace_back(o, 0);
    while (!stack.empty()) {
      auto& [a, next] = stack.back();
      if (next < a.inputs().size()) {
        const mx::array in = a.inputs()[next++];
        if (reference(in)) stack.emplace_back(in, 0);
        continue;
      }
      mix_str(a.primitive().name());
      for (auto& out : a.outputs()) mix_layout(out);
      stack.pop_back();
    }
  }
  return h;
}
VecPtr depends(const ArrayVec& inputs, const ArrayVec& dependencies) { return wrap_vec(mx::depends(inputs, dependencies)); }
VecPtr split_indices(const Array& a, rust::Slice<const int32_t> indices, int32_t axis, StreamSpec s) {
  return wrap_vec(mx::split(a, shape_of(indices), axis, sod(s)));
}
ArrayPtr pad(const Array& a, rust::Slice<const int32_t> axes, Shape low, Shape high, const Array& value, rust::Str mode, StreamSpec s) {
  return wrap(mx::pad(a, ints(axes), shape_of(low), shape_of(high), value, str(mode), sod(s)));
}
ArrayPtr repeat(const Array& a, int32_t repeats, int32_t axis, bool all_axes, StreamSpec s) {
  return wrap(all_axes ? mx::repeat(a, repeats, sod(s)) : mx::repeat(a, repeats, axis, sod(s)));
}
ArrayPtr tile(const Array& a, rust::Slice<const int32_t> reps, StreamSpec s) { return wrap(mx::tile(a, ints(reps), sod(s))); }
ArrayPtr as_strided(const Array& a, Shape shape, rust::Slice<const int64_t> strides, size_t offset, StreamSpec s) {
  return wrap(mx::as_strided(a, shape_of(shape), mx::Strides(strides.begin(), strides.end()), offset, sod(s)));
}
ArrayPtr contiguous(const Array& a, bool allow_col_major, StreamSpec s) { return wrap(mx::contiguous(a, allow_col_major, sod(s))); }
ArrayPtr flip(const Array& a, rust::Slice<const int32_t> axes, StreamSpec s) { return wrap(mx::flip(a, ints(axes), sod(s))); }
ArrayPtr roll(const Array& a, int32_t shift, int32_t axis, bool all_axes, StreamSpec s) {
  return wrap(all_axes ? mx::roll(a, shift, sod(s)) : mx::roll(a, shift, axis, sod(s)));
}
ArrayPtr tril(const Array& a, int32_t k, StreamSpec s) { return wrap(mx::tril(a, k, sod(s))); }
ArrayPtr triu(const Array& a, int32_t k, StreamSpec s) { return wrap(mx::triu(a, k, sod(s))); }

// ---- indexing -----------------------------------------------------------------------------------------

ArrayPtr slice(const Array& a, Shape start, Shape stop, Shape strides, StreamSpec s) {
  return wrap(mx::slice(a, shape_of(start), shape_of(stop), shape_of(strides), sod(s)));
}
ArrayPtr slice_dynamic(const Array& a, const Array& start, rust::Slice<const int32_t> axes, Shape sizes, StreamSpec s) {
  return wrap(mx::slice(a, start, ints(axes), shape_of(sizes), sod(s)));
}
ArrayPtr slice_update(const Array& src, const Array& update, Shape start, Shape stop, Shape strides, StreamSpec s) {
  return wrap(mx::slice_update(src, update, shape_of(start), shape_of(stop), shape_of(strides), sod(s)));
}
ArrayPtr slice_update_dynamic(const Array& src, const Array& update, const Array& start, rust::Slice<const int32_t> axes, StreamSpec s) {
  return wrap(mx::slice_update(src, update, start, ints(axes), sod(s)));
}
ArrayPtr take(const Array& a, const Array& indices, int32_t axis, bool all_axes, StreamSpec s) {
  return wrap(all_axes ? mx::take(a, indices, sod(s)) : mx::take(a, indices, axis, sod(s)));
}
ArrayPtr take_along_axis(const Array& a, const Array& indices, int32_t axis, bool all_axes, StreamSpec st) {
  auto s = sod(st);
  if (all_axes) return wrap(mx::take_along_axis(mx::reshape(a, {-1}, s), indices, 0, s));
  return wrap(mx::take_along_axis(a, indices, axis, s));
}
ArrayPtr put_along_axis(const Array& a, const Array& indices, const Array& values, int32_t axis, bool all_axes, StreamSpec st) {
  auto s = sod(st);
  if (all_axes) {
    auto flat = mx::put_along_axis(mx::reshape(a, {-1}, s), indices, values, 0, s);
    return wrap(mx::reshape(flat, a.shape(), s));
  }
  return wrap(mx::put_along_axis(a, indices, values, axis, s));
}
ArrayPtr scatter_add_axis(const Array& a, const Array& indices, const Array& values, int32_t axis, StreamSpec s) {
  return wrap(mx::scatter_add_axis(a, indices, values, axis, sod(s)));
}
ArrayPtr scatter(const Array& a, const ArrayVec& indices, const Array& updates, rust::Slice<const int32_t> axes, bool add, StreamSpec s) {
  return wrap(add ? mx::scatter_add(a, indices, updates, ints(axes), sod(s))
                  : mx::scatter(a, indices, updates, ints(axes), sod(s)));
}
ArrayPtr gather(const Array& a, const ArrayVec& indices, rust::Slice<const int32_t> axes, Shape slice_sizes, StreamSpec s) {
  return wrap(mx::gather(a, indices, ints(axes), shape_of(slice_sizes), sod(s)));
}

// ---- sorting ------------------------------------------------------------------------------------------

ArrayPtr sort(const Array& a, int32_t axis, bool all_axes, StreamSpec s) {
  return wrap(all_axes ? mx::sort(a, sod(s)) : mx::sort(a, axis, sod(s)));
}
ArrayPtr argsort(const Array& a, int32_t axis, bool all_axes, StreamSpec s) {
  return wrap(all_axes ? mx::argsort(a, sod(s)) : mx::argsort(a, axis, sod(s)));
}
ArrayPtr partition(const Array& a, int32_t kth, int32_t axis, bool all_axes, StreamSpec s) {
  return wrap(all_axes ? mx::partition(a, kth, sod(s)) : mx::partition(a, kth, axis, sod(s)));
}
ArrayPtr argpartition(const Array& a, int32_t kth, int32_t axis, bool all_axes, StreamSpec s) {
  return wrap(all_axes ? mx::argpartition(a, kth, sod(s)) : mx::argpartition(a, kth, axis, sod(s)));
}
ArrayPtr topk(const Array& a, int32_t k, int32_t axis, bool all_axes, StreamSpec s) {
  return wrap(all_axes ? mx::topk(a, k, sod(s)) : mx::topk(a, k, axis, sod(s)));
}

// ---- fast ---------------------------------------------------------------------------------------------

ArrayPtr rms_norm(const Array& x, const Array* weight, float eps, StreamSpec s) {
  return wrap(mx::fast::rms_norm(x, opt(weight), eps, sod(s)));
}
ArrayPtr layer_norm(const Array& x, const Array* weight, const Array* bias, float eps, StreamSpec s) {
  return wrap(mx::fast::layer_norm(x, opt(weight), opt(bias), eps, sod(s)));
}
ArrayPtr rope(const Array& x, int32_t dims, bool traditional, float base, bool has_base, float scale, int32_t offset,
              const Array* offset_array, const Array* freqs, StreamSpec s) {
  std::optional<float> b = has_base ? std::optional<float>(base) : std::nullopt;
  if (offset_array) return wrap(mx::fast::rope(x, dims, traditional, b, scale, *offset_array, opt(freqs), sod(s)));
  return wrap(mx::fast::rope(x, dims, traditional, b, scale, offset, opt(freqs), sod(s)));
}
ArrayPtr scaled_dot_product_attention(const Array& q, const Array& k, const Array& v, float scale, rust::Str mask_mode,
                                      const Array* mask, const Array* sinks, StreamSpec s) {
  return wrap(mx::fast::scaled_dot_product_attention(q, k, v, scale, str(mask_mode), opt(mask), opt(sinks), false, sod(s)));
}

// ---- quantization -------------------------------------------------------------------------------------

VecPtr quantize(const Array& w, int32_t group_size, int32_t bits, rust::Str mode, const Array* global_scale, StreamSpec s) {
  return wrap_vec(mx::quantize(w, opt_int(group_size), opt_int(bits), str(mode), opt(global_scale), sod(s)));
}
ArrayPtr dequantize(const Array& w, const Array& scales, const Array* biases, int32_t group_size, int32_t bits, rust::Str mode,
                    const Array* global_scale, int32_t dtype, StreamSpec s) {
  std::optional<mx::Dtype> d = dtype >= 0 ? std::optional<mx::Dtype>(dt(dtype)) : std::nullopt;
  return wrap(mx::dequantize(w, scales, opt(biases), opt_int(group_size), opt_int(bits), str(mode), opt(global_scale), d, sod(s)));
}
ArrayPtr quantized_matmul(const Array& x, const Array& w, const Array& scales, const Array* biases, bool transpose,
                          int32_t group_size, int32_t bits, rust::Str mode, StreamSpec s) {
  return wrap(mx::quantized_matmul(x, w, scales, opt(biases), transpose, opt_int(group_size), opt_int(bits), str(mode), sod(s)));
}
ArrayPtr gather_qmm(const Array& x, const Array& w, const Array& scales, const Array* biases, const Array* lhs_indices,
                    const Array* rhs_indices, bool transpose, int32_t group_size, int32_t bits, rust::Str mode,
                    bool sorted_indices, StreamSpec s) {
  return wrap(mx::gather_qmm(x, w, scales, opt(biases), opt(lhs_indices), opt(rhs_indices), transpose, opt_int(group_size),
                             opt_int(bits), str(mode), std::nullopt, sorted_indices, sod(s)));
}

// ---- random -------------------------------------------------------------------------------------------

void random_seed(uint64_t seed) {
  bind_thread_defaults();
  mx::random::seed(seed);
}
ArrayPtr random_key(uint64_t seed) {
  bind_thread_defaults();
  return wrap(mx::random::key(seed));
}
ArrayPtr random_split(const Array& key, int32_t num, StreamSpec s) { return wrap(mx::random::split(key, num, sod(s))); }
ArrayPtr random_uniform(const Array& low, const Array& high, Shape shape, uint8_t dtype, const Array* key, StreamSpec s) {
  return wrap(mx::random::uniform(low, high, shape_of(shape), dt(dtype), opt(key), sod(s)));
}
ArrayPtr random_normal(Shape shape, uint8_t dtype, float loc, float scale, const Array* key, StreamSpec s) {
  return wrap(mx::random::normal(shape_of(shape), dt(dtype), mx::array(loc), mx::array(scale), opt(key), sod(s)));
}
ArrayPtr random_truncated_normal(const Array& lower, const Array& upper, Shape shape, uint8_t dtype, const Array* key, StreamSpec s) {
  return wrap(mx::random::truncated_normal(lower, upper, shape_of(shape), dt(dtype), opt(key), sod(s)));
}
ArrayPtr random_randint(const Array& low, const Array& high, Shape shape, uint8_t dtype, const Array* key, StreamSpec s) {
  return wrap(mx::random::randint(low, high, shape_of(shape), dt(dtype), opt(key), sod(s)));
}
ArrayPtr random_bernoulli(const Array& p, Shape shape, const Array* key, StreamSpec s) {
  return wrap(mx::random::bernoulli(p, shape_of(shape), opt(key), sod(s)));
}
ArrayPtr random_categorical(const Array& logits, int32_t axis, int32_t num_samples, const Array* key, StreamSpec s) {
  if (num_samples <= 0) return wrap(mx::random::categorical(logits, axis, opt(key), sod(s)));
  return wrap(mx::random::categorical(logits, axis, num_samples, opt(key), sod(s)));
}
ArrayPtr random_gumbel(Shape shape, uint8_t dtype, const Array* key, StreamSpec s) {
  return wrap(mx::random::gumbel(shape_of(shape), dt(dtype), opt(key), sod(s)));
}
ArrayPtr random_permutation(const Array& x, int32_t axis, const Array* key, StreamSpec s) {
  return wrap(mx::random::permutation(x, axis, opt(key), sod(s)));
}

// ---- io -----------------------------------------------------------------------------------------------

NamedArrays load_safetensors(rust::Str path, StreamSpec s) {
  auto [arrays, meta] = mx::load_safetensors(str(path), sod(s));
  NamedArrays out = named(std::move(arrays));
  std::vector<std::string> keys;
  for (auto& kv : meta) keys.push_back(kv.first);
  std::sort(keys.begin(), keys.end());
  for (auto& k : keys) {
    out.meta_keys.push_back(rust::String(k));
    out.meta_values.push_back(rust::String(meta.at(k)));
  }
  return out;
}

void save_safetensors(rust::Str path, rust::Slice<const rust::String> names, const ArrayVec& arrays,
                      rust::Slice<const rust::String> meta_keys, rust::Slice<const rust::String> meta_values) {
  std::unordered_map<std::string, mx::array> map;
  for (size_t i = 0; i < names.size(); ++i) map.insert_or_assign(std::string(names[i]), arrays.at(i));
  std::unordered_map<std::string, std::string> meta;
  for (size_t i = 0; i < meta_keys.size(); ++i) meta[std::string(meta_keys[i])] = std::string(meta_values[i]);
  mx::save_safetensors(str(path), std::move(map), std::move(meta));
}

NamedArrays load_gguf(rust::Str path, StreamSpec s) {
  auto [arrays, meta] = mx::load_gguf(str(path), sod(s));
  NamedArrays out = named(std::move(arrays));
  std::vector<std::string> keys;
  for (auto& kv : meta) keys.push_back(kv.first);
  std::sort(keys.begin(), keys.end());
  for (auto& k : keys) {
    GgufMeta m{rust::String(k), 0, {}, 0};
    auto& v = meta.at(k);
    if (auto* a = std::get_if<mx::array>(&v)) {
      m.kind = 1;
      m.array_index = out.meta_arrays->size();
      out.meta_arrays->push_back(*a);
    } else if (auto* str_ = std::get_if<std::string>(&v)) {
      m.kind = 2;
      m.strings.push_back(rust::String(*str_));
    } else if (auto* list = std::get_if<std::vector<std::string>>(&v)) {
      m.kind = 3;
      for (auto& e : *list) m.strings.push_back(rust::String(e));
    }
    out.gguf_meta.push_back(std::move(m));
  }
  return out;
}

void save_gguf(rust::Str path, rust::Slice<const rust::String> names, const ArrayVec& arrays,
               rust::Slice<const GgufMeta> meta, const ArrayVec& meta_arrays) {
  std::unordered_map<std::string, mx::array> map;
  for (size_t i = 0; i < names.size(); ++i) map.insert_or_assign(std::string(names[i]), arrays.at(i));
  std::unordered_map<std::string, mx::GGUFMetaData> md;
  for (auto& m : meta) {
    std::string key(m.key);
    switch (m.kind) {
      case 1: md.insert_or_assign(key, mx::GGUFMetaData(meta_arrays.at(m.array_index))); break;
      case 2: md.insert_or_assign(key, mx::GGUFMetaData(std::string(m.strings.at(0)))); break;
      case 3: {
        std::vector<std::string> list;
        for (auto& e : m.strings) list.emplace_back(e);
        md.insert_or_assign(key, mx::GGUFMetaData(std::move(list)));
        break;
      }
      default: md.insert_or_assign(key, mx::GGUFMetaData());
    }
  }
  mx::save_gguf(str(path), std::move(map), std::move(md));
}

ArrayPtr load_npy(rust::Str path, StreamSpec s) { return wrap(mx::load(str(path), sod(s))); }
void save_npy(rust::Str path, const Array& a) { mx::save(str(path), a); }

// ---- memory -------------------------------------------------------------------------------------------

size_t get_active_memory() { return mx::get_active_memory(); }
size_t get_peak_memory() { return mx::get_peak_memory(); }
void reset_peak_memory() { mx::reset_peak_memory(); }
size_t get_cache_memory() { return mx::get_cache_memory(); }
size_t set_memory_limit(size_t limit) { return mx::set_memory_limit(limit); }
size_t get_memory_limit() { return mx::get_memory_limit(); }
size_t set_cache_limit(size_t limit) { return mx::set_cache_limit(limit); }
size_t set_wired_limit(size_t limit) { return mx::set_wired_limit(limit); }
void clear_cache() { mx::clear_cache(); }

// ---- benchmarks ---------------------------------------------------------------------------------------
// The loops of rmlx's `op_overhead` benchmark, written directly against mlx::core, so the binding's
// cost is the difference between the two.

double bench_build_add_chain(int32_t n, StreamSpec st) {
  auto s = sod(st);
  mx::array x = mx::ones({4}, mx::float32, s);
  mx::array one = mx::array(1.0f);
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) x = mx::add(x, one, s);
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(t1 - t0).count();
}

double bench_eval_add_chain(int32_t n, StreamSpec st) {
  auto s = sod(st);
  mx::array x = mx::ones({4}, mx::float32, s);
  mx::array one = mx::array(1.0f);
  mx::eval(x, one);
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) x = mx::add(x, one, s);
  mx::eval(x);
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(t1 - t0).count();
}

double bench_eval_each_add(int32_t n, StreamSpec st) {
  auto s = sod(st);
  mx::array x = mx::ones({4}, mx::float32, s);
  mx::array one = mx::array(1.0f);
  mx::eval(x, one);
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) {
    x = mx::add(x, one, s);
    mx::eval(x);
  }
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(t1 - t0).count();
}

}  // namespace rmlx_shim
