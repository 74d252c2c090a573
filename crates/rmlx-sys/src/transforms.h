// The C++ side of rmlx-sys's transforms bridge: MLX's function transforms over Rust callbacks,
// custom kernels from source, and a Primitive subclass whose behaviour lives in Rust.
#pragma once

#include <functional>
#include <memory>

#include "rmlx-sys/src/lib.rs.h"

namespace rmlx_shim {

struct ArrayFn;
struct VjpFn;
struct JvpFn;
struct VmapFn;
struct OpBox;
struct TransformOut;
struct ShapeDtype;
struct CpuBuffer;
struct KernelSpec;

// A kernel's primitive made once (for one launch, one stream and inputs of fixed shapes and
// dtypes), and the outputs every call makes with it.
struct PreparedKernel {
  std::shared_ptr<mlx::core::Primitive> primitive;
  std::vector<mlx::core::Shape> shapes;
  std::vector<mlx::core::Dtype> dtypes;
};

// A function over arrays produced by a transform; owns whatever Rust callbacks it calls.
struct ArrayFunction {
  std::function<std::vector<mlx::core::array>(const std::vector<mlx::core::array>&)> fun;
};

TransformOut vjp(const ArrayFn& f, const ArrayVec& primals, const ArrayVec& cotangents, StreamSpec s);
TransformOut jvp(const ArrayFn& f, const ArrayVec& primals, const ArrayVec& tangents, StreamSpec s);
TransformOut value_and_grad(const ArrayFn& f, const ArrayVec& inputs, rust::Slice<const int32_t> argnums,
                            StreamSpec s);
VecPtr vmap(const ArrayFn& f, const ArrayVec& inputs, rust::Slice<const int32_t> in_axes,
            rust::Slice<const int32_t> out_axes, StreamSpec s);
std::unique_ptr<ArrayFunction> checkpoint(rust::Box<ArrayFn> f);
std::unique_ptr<ArrayFunction> custom_function(rust::Box<ArrayFn> f, rust::Box<VjpFn> vjp, bool has_vjp,
                                               rust::Box<JvpFn> jvp, bool has_jvp, rust::Box<VmapFn> vmap,
                                               bool has_vmap);
std::unique_ptr<ArrayFunction> compile(rust::Box<ArrayFn> f, size_t fun_id, bool shapeless);
VecPtr call_function(const ArrayFunction& f, const ArrayVec& inputs, StreamSpec s);
void compile_erase(size_t fun_id);
void compile_clear_cache();
void set_compile_enabled(bool enabled);
bool array_is_tracer(const Array& a);
bool array_known_row_contiguous(const Array& a);
size_t eval_thread_token();
void set_eval_caller(size_t token);

uint8_t gpu_backend();
VecPtr custom_kernel(const KernelSpec& spec, const ArrayVec& inputs, rust::Slice<const ShapeDtype> outputs,
                     StreamSpec s);
std::unique_ptr<PreparedKernel> prepare_kernel(const KernelSpec& spec, const ArrayVec& inputs,
                                               rust::Slice<const ShapeDtype> outputs, StreamSpec s);
VecPtr call_prepared(const PreparedKernel& kernel, const ArrayVec& inputs);
VecPtr custom_primitive(rust::Box<OpBox> op, const ArrayVec& inputs, rust::Slice<const ShapeDtype> outputs,
                        rust::Slice<const int32_t> in_place, bool owned, StreamSpec s);
rust::String array_primitive_name(const Array& a);

}  // namespace rmlx_shim
