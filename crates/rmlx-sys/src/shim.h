// The C++ side of rmlx-sys: one small function per MLX call, converting arguments from the cxx
// bridge's types. No logic beyond conversions lives here; exceptions propagate to cxx, which turns
// them into Rust errors.
#pragma once

#include <memory>
#include <vector>

#include "mlx/mlx.h"
#include "rust/cxx.h"

namespace rmlx_shim {

using Array = mlx::core::array;
using ArrayVec = std::vector<mlx::core::array>;

struct StreamSpec;
struct NamedArrays;
struct GgufMeta;
enum class UnaryOp : uint8_t;
enum class BinaryOp : uint8_t;
enum class ReduceOp : uint8_t;
enum class ScanOp : uint8_t;

using ArrayPtr = std::unique_ptr<Array>;
using VecPtr = std::unique_ptr<ArrayVec>;
using Shape = rust::Slice<const int32_t>;

// Helpers shared with the other shim files (transforms.cc).
namespace detail {
mlx::core::Dtype dtype_of_code(uint8_t code);
uint8_t code_of_dtype(mlx::core::Dtype d);
mlx::core::StreamOrDevice stream_of(const StreamSpec& s);
// Binds rmlx's shared streams as this thread's MLX defaults (once per thread).
void bind_thread();
}  // namespace detail

rust::String mlx_version();
StreamSpec default_device();
void set_default_device(uint8_t device_type, int32_t index);
bool is_available(uint8_t device_type, int32_t index);
int32_t device_count(uint8_t device_type);
rust::Vec<rust::String> device_info(uint8_t device_type, int32_t index);
StreamSpec default_stream(uint8_t device_type, int32_t index);
StreamSpec new_stream(uint8_t device_type, int32_t index);
void synchronize(StreamSpec s);
void init_runtime();
int32_t blas_threads(int32_t threads);

ArrayPtr array_from_data(rust::Slice<const uint8_t> data, Shape shape, uint8_t dtype);
ArrayPtr array_from_f64(double value, uint8_t dtype);
ArrayPtr array_from_i64(int64_t value, uint8_t dtype);
ArrayPtr array_from_bool(bool value);
ArrayPtr array_from_complex(float re, float im);
ArrayPtr array_clone(const Array& a);
rust::Slice<const int32_t> array_shape(const Array& a);
rust::Slice<const int64_t> array_strides(const Array& a);
uint8_t array_dtype(const Array& a);
size_t array_size(const Array& a);
size_t array_nbytes(const Array& a);
size_t array_itemsize(const Array& a);
size_t array_id(const Array& a);
bool array_is_evaluated(const Array& a);
bool array_row_contiguous(const Array& a);
void array_copy_to(const Array& a, rust::Slice<uint8_t> out);
bool array_copy_ready(const Array& a, rust::Slice<uint8_t> out);
bool array_wait(const Array& a);
rust::String array_to_string(const Array& a);
rust::String graph_census(const ArrayVec& outputs);
uint64_t graph_signature(const ArrayVec& outputs);
void array_eval(const Array& a);
uint8_t result_type(const Array& a, const Array& b);

VecPtr vec_new();
void vec_push(ArrayVec& v, const Array& a);
size_t vec_len(const ArrayVec& v);
ArrayPtr vec_get(const ArrayVec& v, size_t i);
void eval(const ArrayVec& v);
void async_eval(const ArrayVec& v);

ArrayPtr zeros(Shape shape, uint8_t dtype, StreamSpec s);
ArrayPtr ones(Shape shape, uint8_t dtype, StreamSpec s);
ArrayPtr full(Shape shape, const Array& value, uint8_t dtype, StreamSpec s);
ArrayPtr arange(double start, double stop, double step, uint8_t dtype, StreamSpec s);
ArrayPtr linspace(double start, double stop, int32_t num, uint8_t dtype, StreamSpec s);
ArrayPtr eye(int32_t n, int32_t m, int32_t k, uint8_t dtype, StreamSpec s);
ArrayPtr tri(int32_t n, int32_t m, int32_t k, uint8_t dtype, StreamSpec s);

ArrayPtr unary(UnaryOp op, const Array& a, StreamSpec s);
ArrayPtr binary(BinaryOp op, const Array& a, const Array& b, StreamSpec s);
ArrayPtr round(const Array& a, int32_t decimals, StreamSpec s);
ArrayPtr where_(const Array& cond, const Array& x, const Array& y, StreamSpec s);
ArrayPtr clip(const Array& a, const Array* lo, const Array* hi, StreamSpec s);
ArrayPtr astype(const Array& a, uint8_t dtype, StreamSpec s);
ArrayPtr view(const Array& a, uint8_t dtype, StreamSpec s);
ArrayPtr isclose(const Array& a, const Array& b, double rtol, double atol, bool equal_nan, StreamSpec s);
ArrayPtr array_equal(const Array& a, const Array& b, bool equal_nan, StreamSpec s);

ArrayPtr reduce(ReduceOp op, const Array& a, rust::Slice<const int32_t> axes, bool all_axes, bool keepdims, StreamSpec s);
ArrayPtr argmax(const Array& a, int32_t axis, bool all_axes, bool keepdims, StreamSpec s);
ArrayPtr argmin(const Array& a, int32_t axis, bool all_axes, bool keepdims, StreamSpec s);
ArrayPtr var(const Array& a, rust::Slice<const int32_t> axes, bool all_axes, bool keepdims, int32_t ddof, StreamSpec s);
ArrayPtr std(const Array& a, rust::Slice<const int32_t> axes, bool all_axes, bool keepdims, int32_t ddof, StreamSpec s);
ArrayPtr softmax(const Array& a, rust::Slice<const int32_t> axes, bool all_axes, bool precise, StreamSpec s);
ArrayPtr scan(ScanOp op, const Array& a, int32_t axis, bool all_axes, bool reverse, bool inclusive, StreamSpec s);

ArrayPtr addmm(const Array& c, const Array& a, const Array& b, float alpha, float beta, StreamSpec s);
ArrayPtr gather_mm(const Array& a, const Array& b, const Array* lhs_indices, const Array* rhs_indices, bool sorted_indices, StreamSpec s);
ArrayPtr einsum(rust::Str subscripts, const ArrayVec& operands, StreamSpec s);
ArrayPtr tensordot(const Array& a, const Array& b, rust::Slice<const int32_t> axes_a, rust::Slice<const int32_t> axes_b, StreamSpec s);

ArrayPtr reshape(const Array& a, Shape shape, StreamSpec s);
ArrayPtr transpose(const Array& a, rust::Slice<const int32_t> axes, bool all_axes, StreamSpec s);
ArrayPtr swapaxes(const Array& a, int32_t axis1, int32_t axis2, StreamSpec s);
ArrayPtr moveaxis(const Array& a, int32_t source, int32_t destination, StreamSpec s);
ArrayPtr expand_dims(const Array& a, rust::Slice<const int32_t> axes, StreamSpec s);
ArrayPtr squeeze(const Array& a, rust::Slice<const int32_t> axes, bool all_axes, StreamSpec s);
ArrayPtr flatten(const Array& a, int32_t start_axis, int32_t end_axis, StreamSpec s);
ArrayPtr unflatten(const Array& a, int32_t axis, Shape shape, StreamSpec s);
ArrayPtr broadcast_to(const Array& a, Shape shape, StreamSpec s);
ArrayPtr concatenate(const ArrayVec& arrays, int32_t axis, StreamSpec s);
ArrayPtr stack(const ArrayVec& arrays, int32_t axis, StreamSpec s);
VecPtr split_sections(const Array& a, int32_t num, int32_t axis, StreamSpec s);
VecPtr depends(const ArrayVec& inputs, const ArrayVec& dependencies);
VecPtr split_indices(const Array& a, rust::Slice<const int32_t> indices, int32_t axis, StreamSpec s);
ArrayPtr pad(const Array& a, rust::Slice<const int32_t> axes, Shape low, Shape high, const Array& value, rust::Str mode, StreamSpec s);
ArrayPtr repeat(const Array& a, int32_t repeats, int32_t axis, bool all_axes, StreamSpec s);
ArrayPtr tile(const Array& a, rust::Slice<const int32_t> reps, StreamSpec s);
ArrayPtr as_strided(const Array& a, Shape shape, rust::Slice<const int64_t> strides, size_t offset, StreamSpec s);
ArrayPtr contiguous(const Array& a, bool allow_col_major, StreamSpec s);
ArrayPtr flip(const Array& a, rust::Slice<const int32_t> axes, StreamSpec s);
ArrayPtr roll(const Array& a, int32_t shift, int32_t axis, bool all_axes, StreamSpec s);
ArrayPtr tril(const Array& a, int32_t k, StreamSpec s);
ArrayPtr triu(const Array& a, int32_t k, StreamSpec s);

ArrayPtr slice(const Array& a, Shape start, Shape stop, Shape strides, StreamSpec s);
ArrayPtr slice_dynamic(const Array& a, const Array& start, rust::Slice<const int32_t> axes, Shape sizes, StreamSpec s);
ArrayPtr slice_update(const Array& src, const Array& update, Shape start, Shape stop, Shape strides, StreamSpec s);
ArrayPtr slice_update_dynamic(const Array& src, const Array& update, const Array& start, rust::Slice<const int32_t> axes, StreamSpec s);
ArrayPtr take(const Array& a, const Array& indices, int32_t axis, bool all_axes, StreamSpec s);
ArrayPtr take_along_axis(const Array& a, const Array& indices, int32_t axis, bool all_axes, StreamSpec s);
ArrayPtr put_along_axis(const Array& a, const Array& indices, const Array& values, int32_t axis, bool all_axes, StreamSpec s);
ArrayPtr scatter_add_axis(const Array& a, const Array& indices, const Array& values, int32_t axis, StreamSpec s);
ArrayPtr scatter(const Array& a, const ArrayVec& indices, const Array& updates, rust::Slice<const int32_t> axes, bool add, StreamSpec s);
ArrayPtr gather(const Array& a, const ArrayVec& indices, rust::Slice<const int32_t> axes, Shape slice_sizes, StreamSpec s);

ArrayPtr sort(const Array& a, int32_t axis, bool all_axes, StreamSpec s);
ArrayPtr argsort(const Array& a, int32_t axis, bool all_axes, StreamSpec s);
ArrayPtr partition(const Array& a, int32_t kth, int32_t axis, bool all_axes, StreamSpec s);
ArrayPtr argpartition(const Array& a, int32_t kth, int32_t axis, bool all_axes, StreamSpec s);
ArrayPtr topk(const Array& a, int32_t k, int32_t axis, bool all_axes, StreamSpec s);

ArrayPtr rms_norm(const Array& x, const Array* weight, float eps, StreamSpec s);
ArrayPtr layer_norm(const Array& x, const Array* weight, const Array* bias, float eps, StreamSpec s);
ArrayPtr rope(const Array& x, int32_t dims, bool traditional, float base, bool has_base, float scale, int32_t offset, const Array* offset_array, const Array* freqs, StreamSpec s);
ArrayPtr scaled_dot_product_attention(const Array& q, const Array& k, const Array& v, float scale, rust::Str mask_mode, const Array* mask, const Array* sinks, StreamSpec s);

VecPtr quantize(const Array& w, int32_t group_size, int32_t bits, rust::Str mode, const Array* global_scale, StreamSpec s);
ArrayPtr dequantize(const Array& w, const Array& scales, const Array* biases, int32_t group_size, int32_t bits, rust::Str mode, const Array* global_scale, int32_t dtype, StreamSpec s);
ArrayPtr quantized_matmul(const Array& x, const Array& w, const Array& scales, const Array* biases, bool transpose, int32_t group_size, int32_t bits, rust::Str mode, StreamSpec s);
ArrayPtr gather_qmm(const Array& x, const Array& w, const Array& scales, const Array* biases, const Array* lhs_indices, const Array* rhs_indices, bool transpose, int32_t group_size, int32_t bits, rust::Str mode, bool sorted_indices, StreamSpec s);

void random_seed(uint64_t seed);
ArrayPtr random_key(uint64_t seed);
ArrayPtr random_split(const Array& key, int32_t num, StreamSpec s);
ArrayPtr random_uniform(const Array& low, const Array& high, Shape shape, uint8_t dtype, const Array* key, StreamSpec s);
ArrayPtr random_normal(Shape shape, uint8_t dtype, float loc, float scale, const Array* key, StreamSpec s);
ArrayPtr random_truncated_normal(const Array& lower, const Array& upper, Shape shape, uint8_t dtype, const Array* key, StreamSpec s);
ArrayPtr random_randint(const Array& low, const Array& high, Shape shape, uint8_t dtype, const Array* key, StreamSpec s);
ArrayPtr random_bernoulli(const Array& p, Shape shape, const Array* key, StreamSpec s);
ArrayPtr random_categorical(const Array& logits, int32_t axis, int32_t num_samples, const Array* key, StreamSpec s);
ArrayPtr random_gumbel(Shape shape, uint8_t dtype, const Array* key, StreamSpec s);
ArrayPtr random_permutation(const Array& x, int32_t axis, const Array* key, StreamSpec s);

NamedArrays load_safetensors(rust::Str path, StreamSpec s);
void save_safetensors(rust::Str path, rust::Slice<const rust::String> names, const ArrayVec& arrays, rust::Slice<const rust::String> meta_keys, rust::Slice<const rust::String> meta_values);
NamedArrays load_gguf(rust::Str path, StreamSpec s);
void save_gguf(rust::Str path, rust::Slice<const rust::String> names, const ArrayVec& arrays, rust::Slice<const GgufMeta> meta, const ArrayVec& meta_arrays);
ArrayPtr load_npy(rust::Str path, StreamSpec s);
void save_npy(rust::Str path, const Array& a);

size_t get_active_memory();
size_t get_peak_memory();
void reset_peak_memory();
size_t get_cache_memory();
size_t set_memory_limit(size_t limit);
size_t get_memory_limit();
size_t set_cache_limit(size_t limit);
size_t set_wired_limit(size_t limit);
void clear_cache();

double bench_build_add_chain(int32_t n, StreamSpec s);
double bench_eval_add_chain(int32_t n, StreamSpec s);
double bench_eval_each_add(int32_t n, StreamSpec s);

}  // namespace rmlx_shim
