// Implementations of transforms.h. Rust callbacks are wrapped into std::functions; a callback that
// fails throws (cxx turns the Rust `Err` into `rust::Error`), and MLX lets the exception through to
// the shim call, where cxx hands it back to Rust.
#include "rmlx-sys/src/transforms.rs.h"

#include "mlx/backend/cpu/encoder.h"
#include "mlx/backend/cuda/cuda.h"
#include "mlx/backend/metal/metal.h"
#include "mlx/compile_impl.h"
#include "mlx/primitives.h"

#include <cstring>
#include <stdexcept>
#include <thread>

namespace mx = mlx::core;

namespace rmlx_shim {
namespace {

using Arrays = std::vector<mx::array>;
using Function = std::function<Arrays(const Arrays&)>;

VecPtr to_vec(Arrays v) { return std::make_unique<ArrayVec>(std::move(v)); }

rust::Slice<const int32_t> int_slice(const std::vector<int>& v) {
  return rust::Slice<const int32_t>(reinterpret_cast<const int32_t*>(v.data()), v.size());
}

// A borrowed callback: valid only during the transform call that receives it.
Function borrowed(const ArrayFn& f) {
  return [&f](const Arrays& args) { return std::move(*call_array_fn(f, args)); };
}

// An owned callback: the std::function (and every copy MLX makes of it) keeps the Rust box alive.
Function owned(rust::Box<ArrayFn> f) {
  auto shared = std::make_shared<rust::Box<ArrayFn>>(std::move(f));
  return [shared](const Arrays& args) { return std::move(*call_array_fn(**shared, args)); };
}

ShapeDtype spec_of(const mx::array& a) {
  ShapeDtype s{};
  for (auto d : a.shape()) s.shape.push_back(d);
  s.dtype = detail::code_of_dtype(a.dtype());
  return s;
}

rust::Vec<ShapeDtype> specs_of(const Arrays& arrays) {
  rust::Vec<ShapeDtype> out;
  for (auto& a : arrays) out.push_back(spec_of(a));
  return out;
}

std::vector<mx::Shape> shapes_of(rust::Slice<const ShapeDtype> specs) {
  std::vector<mx::Shape> out;
  for (auto& s : specs) out.emplace_back(s.shape.begin(), s.shape.end());
  return out;
}

std::vector<mx::Dtype> dtypes_of(rust::Slice<const ShapeDtype> specs) {
  std::vector<mx::Dtype> out;
  for (auto& s : specs) out.push_back(detail::dtype_of_code(s.dtype));
  return out;
}

std::vector<std::string> strings(const rust::Vec<rust::String>& v) {
  std::vector<std::string> out;
  for (auto& s : v) out.emplace_back(std::string(s));
  return out;
}

mx::fast::CustomKernelFunction make_kernel(const KernelSpec& spec) {
  auto in = strings(spec.input_names);
  auto out = strings(spec.output_names);
  if (spec.backend == 1) {
    return mx::fast::cuda_kernel(std::string(spec.name), in, out, std::string(spec.source),
                                 std::string(spec.header), spec.ensure_row_contiguous, spec.shared_memory);
  }
  if (spec.backend == 2) {
    return mx::fast::metal_kernel(std::string(spec.name), in, out, std::string(spec.source),
                                  std::string(spec.header), spec.ensure_row_contiguous, spec.atomic_outputs);
  }
  throw std::invalid_argument("[rmlx] unknown kernel backend code " + std::to_string(spec.backend));
}

Arrays launch(const KernelSpec& spec, const Arrays& inputs, const std::vector<mx::Shape>& shapes,
              const std::vector<mx::Dtype>& dtypes, mx::StreamOrDevice s) {
  std::vector<std::pair<std::string, mx::fast::TemplateArg>> tmpl;
  for (size_t i = 0; i < spec.template_names.size(); ++i) {
    std::string name(spec.template_names[i]);
    int value = spec.template_values[i];
    switch (spec.template_kinds[i]) {
      case 0: tmpl.emplace_back(name, value); break;
      case 1: tmpl.emplace_back(name, value != 0); break;
      default: tmpl.emplace_back(name, detail::dtype_of_code(static_cast<uint8_t>(value))); break;
    }
  }
  std::optional<float> init = spec.has_init_value ? std::optional<float>(spec.init_value) : std::nullopt;
  auto kernel = make_kernel(spec);
  return kernel(inputs, shapes, dtypes, {spec.grid[0], spec.grid[1], spec.grid[2]},
                {spec.threadgroup[0], spec.threadgroup[1], spec.threadgroup[2]}, tmpl, init, false, s);
}

CpuBuffer buffer_of(const mx::array& a) {
  CpuBuffer b{};
  b.ptr = reinterpret_cast<size_t>(a.data<char>());
  b.nbytes = a.nbytes();
  b.dtype = detail::code_of_dtype(a.dtype());
  for (auto d : a.shape()) b.shape.push_back(d);
  return b;
}

// A primitive whose evaluation and transforms are implemented in Rust (rmlx's CustomPrimitive).
class RustPrimitive : public mx::Primitive {
 public:
  RustPrimitive(mx::Stream stream, rust::Box<OpBox> op, std::vector<int> aliases = {}, bool owned = false)
      : mx::Primitive(stream),
        op_(std::make_shared<rust::Box<OpBox>>(std::move(op))),
        name_(std::string(op_name(**op_))),
        aliases_(std::move(aliases)),
        owned_(owned) {}

  void eval_cpu(const Arrays& inputs, Arrays& outputs) override {
    for (auto& in : inputs) {
      if (!in.flags().row_contiguous) {
        throw std::runtime_error("[" + name_ + "] internal error: an input is not row-contiguous");
      }
    }
    // Inputs taken over by an output reach the op empty; `copies` pairs an output with the input
    // it starts as a copy of (where the input's own buffer may not be updated).
    std::vector<bool> taken(inputs.size(), false);
    std::vector<std::pair<size_t, size_t>> copies;
    for (size_t j = 0; j < outputs.size(); ++j) {
      auto& o = outputs[j];
      int alias = j < aliases_.size() ? aliases_[j] : -1;
      if (alias < 0) {
        o.set_data(mx::allocator::malloc(o.nbytes()));
        continue;
      }
      const mx::array& in = inputs.at(alias);
      if (in.dtype() != o.dtype() || in.size() != o.size()) {
        throw std::invalid_argument("[" + name_ + "] an output updated in place differs from its input");
      }
      taken[alias] = true;
      if (owned_ || in.is_donatable()) {
        o.copy_shared_buffer(in);
      } else {
        o.set_data(mx::allocator::malloc(o.nbytes()));
        copies.emplace_back(j, static_cast<size_t>(alias));
      }
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) encoder.set_input_array(in);
    for (auto& o : outputs) encoder.set_output_array(o);
    // The task runs on MLX's CPU worker; the copies keep the buffers (and the Rust op) alive.
    // Failures are reported to the thread that asked for this evaluation.
    encoder.dispatch([op = op_, ins = inputs, outs = outputs, taken, copies, token = eval_thread_token()]() {
      for (auto [j, i] : copies) {
        auto& out = const_cast<mx::array&>(outs[j]);
        std::memcpy(out.data<char>(), ins[i].data<char>(), out.nbytes());
      }
      rust::Vec<CpuBuffer> in_buffers, out_buffers;
      for (size_t i = 0; i < ins.size(); ++i) {
        in_buffers.push_back(buffer_of(ins[i]));
        if (taken[i]) in_buffers.back().nbytes = 0;
      }
      for (auto& a : outs) out_buffers.push_back(buffer_of(a));
      op_eval_cpu(**op, rust::Slice<const CpuBuffer>(in_buffers.data(), in_buffers.size()),
                  rust::Slice<const CpuBuffer>(out_buffers.data(), out_buffers.size()), token);
    });
  }

  void eval_gpu(const Arrays& inputs, Arrays& outputs) override {
    auto in_specs = specs_of(inputs);
    auto out_specs = specs_of(outputs);
    KernelSpec spec{};
    bool found = op_gpu_kernel(**op_, gpu_backend(), rust::Slice<const ShapeDtype>(in_specs.data(), in_specs.size()),
                               rust::Slice<const ShapeDtype>(out_specs.data(), out_specs.size()), spec);
    if (!found) {
      throw std::runtime_error("[" + name_ + "] has no GPU kernel for this backend");
    }
    std::vector<mx::Shape> shapes;
    std::vector<mx::Dtype> dtypes;
    for (auto& o : outputs) {
      shapes.push_back(o.shape());
      dtypes.push_back(o.dtype());
    }
    // Build the kernel's own primitive and let it evaluate into our outputs.
    auto staged = launch(spec, inputs, shapes, dtypes, stream());
    kernels_.push_back(staged[0].primitive_ptr());
    staged[0].primitive().eval_gpu(inputs, outputs);
  }

  std::vector<mx::array> vjp(const Arrays& primals, const Arrays& cotangents, const std::vector<int>& argnums,
                             const Arrays& outputs) override {
    return std::move(*op_vjp(**op_, primals, cotangents, int_slice(argnums), outputs));
  }

  std::vector<mx::array> jvp(const Arrays& primals, const Arrays& tangents, const std::vector<int>& argnums) override {
    return std::move(*op_jvp(**op_, primals, tangents, int_slice(argnums)));
  }

  std::pair<Arrays, std::vector<int>> vmap(const Arrays& inputs, const std::vector<int>& axes) override {
    rust::Vec<int32_t> out_axes;
    auto outs = op_vmap(**op_, inputs, int_slice(axes), out_axes);
    return {std::move(*outs), std::vector<int>(out_axes.begin(), out_axes.end())};
  }

  const char* name() const override { return name_.c_str(); }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const RustPrimitive*>(&other);
    return o != nullptr && op_equivalent(**op_, **o->op_);
  }

  std::vector<mx::Shape> output_shapes(const Arrays& inputs) override {
    auto in_specs = specs_of(inputs);
    auto outs = op_output_specs(**op_, rust::Slice<const ShapeDtype>(in_specs.data(), in_specs.size()));
    std::vector<mx::Shape> shapes;
    for (auto& s : outs) shapes.emplace_back(s.shape.begin(), s.shape.end());
    return shapes;
  }

 private:
  std::shared_ptr<rust::Box<OpBox>> op_;
  std::string name_;
  std::vector<std::shared_ptr<mx::Primitive>> kernels_;
  // Per output, the input whose buffer it takes over on the CPU (or -1), and whether always.
  std::vector<int> aliases_;
  bool owned_;
};

// MLX's transforms build some arrays of their own (cotangents of ones, zeros for missing tangents)
// on the default device. While a transform runs, that is the device rmlx's caller selected
// (`with_device`), not the process default: so a float64 gradient asked for on the CPU of a GPU
// machine stays on the CPU. Safe because rmlx serialises all calls into MLX.
class DeviceScope {
 public:
  explicit DeviceScope(const StreamSpec& s) : previous_(mx::default_device()) {
    detail::bind_thread();
    if (s.kind == 0) return;
    auto wanted = mx::to_stream(detail::stream_of(s)).device;
    if (wanted != previous_) {
      mx::set_default_device(wanted);
      changed_ = true;
    }
  }
  ~DeviceScope() {
    if (changed_) mx::set_default_device(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  mx::Device previous_;
  bool changed_ = false;
};

}  // namespace

TransformOut vjp(const ArrayFn& f, const ArrayVec& primals, const ArrayVec& cotangents, StreamSpec s) {
  DeviceScope scope(s);
  auto [outs, vjps] = mx::vjp(borrowed(f), primals, cotangents);
  return TransformOut{to_vec(std::move(outs)), to_vec(std::move(vjps))};
}

TransformOut jvp(const ArrayFn& f, const ArrayVec& primals, const ArrayVec& tangents, StreamSpec s) {
  DeviceScope scope(s);
  auto [outs, jvps] = mx::jvp(borrowed(f), primals, tangents);
  return TransformOut{to_vec(std::move(outs)), to_vec(std::move(jvps))};
}

TransformOut value_and_grad(const ArrayFn& f, const ArrayVec& inputs, rust::Slice<const int32_t> argnums,
                            StreamSpec s) {
  DeviceScope scope(s);
  auto fun = mx::value_and_grad(borrowed(f), std::vector<int>(argnums.begin(), argnums.end()));
  auto [values, grads] = fun(inputs);
  return TransformOut{to_vec(std::move(values)), to_vec(std::move(grads))};
}

VecPtr vmap(const ArrayFn& f, const ArrayVec& inputs, rust::Slice<const int32_t> in_axes,
            rust::Slice<const int32_t> out_axes, StreamSpec s) {
  DeviceScope scope(s);
  auto fun = mx::vmap(borrowed(f), std::vector<int>(in_axes.begin(), in_axes.end()),
                      std::vector<int>(out_axes.begin(), out_axes.end()));
  return to_vec(fun(inputs));
}

std::unique_ptr<ArrayFunction> checkpoint(rust::Box<ArrayFn> f) {
  return std::make_unique<ArrayFunction>(ArrayFunction{mx::checkpoint(owned(std::move(f)))});
}

std::unique_ptr<ArrayFunction> custom_function(rust::Box<ArrayFn> f, rust::Box<VjpFn> vjp, bool has_vjp,
                                               rust::Box<JvpFn> jvp, bool has_jvp, rust::Box<VmapFn> vmap,
                                               bool has_vmap) {
  std::optional<std::function<Arrays(const Arrays&, const Arrays&, const Arrays&)>> fun_vjp;
  std::optional<std::function<Arrays(const Arrays&, const Arrays&, const std::vector<int>&)>> fun_jvp;
  std::optional<std::function<std::pair<Arrays, std::vector<int>>(const Arrays&, const std::vector<int>&)>> fun_vmap;
  if (has_vjp) {
    auto g = std::make_shared<rust::Box<VjpFn>>(std::move(vjp));
    fun_vjp = [g](const Arrays& primals, const Arrays& cotangents, const Arrays& outputs) {
      return std::move(*call_vjp_fn(**g, primals, cotangents, outputs));
    };
  }
  if (has_jvp) {
    auto g = std::make_shared<rust::Box<JvpFn>>(std::move(jvp));
    fun_jvp = [g](const Arrays& primals, const Arrays& tangents, const std::vector<int>& argnums) {
      return std::move(*call_jvp_fn(**g, primals, tangents, int_slice(argnums)));
    };
  }
  if (has_vmap) {
    auto g = std::make_shared<rust::Box<VmapFn>>(std::move(vmap));
    fun_vmap = [g](const Arrays& inputs, const std::vector<int>& axes) {
      rust::Vec<int32_t> out_axes;
      auto outs = call_vmap_fn(**g, inputs, int_slice(axes), out_axes);
      return std::make_pair(std::move(*outs), std::vector<int>(out_axes.begin(), out_axes.end()));
    };
  }
  return std::make_unique<ArrayFunction>(
      ArrayFunction{mx::custom_function(owned(std::move(f)), fun_vjp, fun_jvp, fun_vmap)});
}

std::unique_ptr<ArrayFunction> compile(rust::Box<ArrayFn> f, size_t fun_id, bool shapeless) {
  // MLX keys compiled traces by the thread's default stream: bind rmlx's before the first trace.
  detail::bind_thread();
  return std::make_unique<ArrayFunction>(ArrayFunction{mx::detail::compile(owned(std::move(f)), fun_id, shapeless)});
}

VecPtr call_function(const ArrayFunction& f, const ArrayVec& inputs, StreamSpec s) {
  DeviceScope scope(s);
  return to_vec(f.fun(inputs));
}

namespace {
// The thread an evaluation is done for, when this thread evaluates on another's behalf (0: itself).
thread_local size_t eval_caller = 0;
}  // namespace

size_t eval_thread_token() {
  return eval_caller != 0 ? eval_caller : std::hash<std::thread::id>{}(std::this_thread::get_id());
}

void set_eval_caller(size_t token) { eval_caller = token; }

void compile_erase(size_t fun_id) { mx::detail::compile_erase(mx::detail::compile_cache(), fun_id); }

void compile_clear_cache() { mx::detail::compile_clear_cache(mx::detail::compile_cache()); }

void set_compile_enabled(bool enabled) {
  if (enabled) {
    mx::enable_compile();
  } else {
    mx::disable_compile();
  }
}

bool array_is_tracer(const Array& a) { return a.is_tracer(); }

// Whether `a` is (or will be, once computed) laid out row-major without gaps: computed so, an
// output of a RustPrimitive (whose outputs are allocated so), or MLX's slice update of such an
// array (which copies or takes over its input's layout).
bool array_known_row_contiguous(const Array& a) {
  mx::array x = a;
  for (;;) {
    if (x.status() != mx::array::Status::unscheduled) return x.flags().row_contiguous;
    if (!x.has_primitive()) return false;
    const mx::Primitive& p = x.primitive();
    if (dynamic_cast<const RustPrimitive*>(&p) != nullptr) return true;
    if (std::string(p.name()) != "SliceUpdate" || x.inputs().empty()) return false;
    x = x.inputs()[0];
  }
}

uint8_t gpu_backend() {
  if (mx::cu::is_available()) return 1;
  if (mx::metal::is_available()) return 2;
  return 0;
}

VecPtr custom_kernel(const KernelSpec& spec, const ArrayVec& inputs, rust::Slice<const ShapeDtype> outputs,
                     StreamSpec s) {
  return to_vec(launch(spec, inputs, shapes_of(outputs), dtypes_of(outputs), detail::stream_of(s)));
}

std::unique_ptr<PreparedKernel> prepare_kernel(const KernelSpec& spec, const ArrayVec& inputs,
                                               rust::Slice<const ShapeDtype> outputs, StreamSpec s) {
  auto shapes = shapes_of(outputs);
  auto dtypes = dtypes_of(outputs);
  // MLX's kernel function assembles the source and makes the primitive; the arrays made here are
  // never evaluated.
  auto staged = launch(spec, inputs, shapes, dtypes, detail::stream_of(s));
  return std::make_unique<PreparedKernel>(PreparedKernel{staged[0].primitive_ptr(), shapes, dtypes});
}

VecPtr call_prepared(const PreparedKernel& kernel, const ArrayVec& inputs) {
  return to_vec(mx::array::make_arrays(kernel.shapes, kernel.dtypes, kernel.primitive, inputs));
}

VecPtr custom_primitive(rust::Box<OpBox> op, const ArrayVec& inputs, rust::Slice<const ShapeDtype> outputs,
                        rust::Slice<const int32_t> in_place, bool owned, StreamSpec s) {
  auto stream = mx::to_stream(detail::stream_of(s));
  std::vector<int> aliases(outputs.size(), -1);
  for (size_t j = 0; j < in_place.size() && j < aliases.size(); ++j) {
    if (in_place[j] >= static_cast<int32_t>(inputs.size())) {
      throw std::invalid_argument("an output takes over a missing input");
    }
    aliases[j] = in_place[j];
  }
  auto primitive = std::make_shared<RustPrimitive>(stream, std::move(op), std::move(aliases), owned);
  return to_vec(mx::array::make_arrays(shapes_of(outputs), dtypes_of(outputs), primitive, inputs));
}

rust::String array_primitive_name(const Array& a) {
  return a.has_primitive() ? rust::String(a.primitive().name()) : rust::String();
}

}  // namespace rmlx_shim
