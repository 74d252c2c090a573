// The C++ side of rmlx-sys's CUDA bridge: NVRTC, the CUDA driver and a primitive adding kernels of
// rmlx's own to MLX's CUDA graph (see cuda.rs).
#pragma once

#include <memory>

#include "rmlx-sys/src/lib.rs.h"

namespace rmlx_shim {

struct KernelNode;
struct KernelArg;
struct LaunchOutput;
struct GraphNode;

// A launch primitive made once, and the outputs every call makes with it.
struct PreparedLaunch {
  std::shared_ptr<mlx::core::Primitive> primitive;
  std::vector<mlx::core::Shape> shapes;
  std::vector<mlx::core::Dtype> dtypes;
};

rust::String cuda_unavailable();
rust::String cuda_overlap_unavailable(int32_t device);
int32_t cuda_compute_capability(int32_t device);
int32_t cuda_multiprocessors(int32_t device);
int32_t nvrtc_version();
rust::Vec<uint8_t> nvrtc_compile(rust::Str source, rust::Str name, int32_t arch);
uint64_t cuda_load_function(int32_t device, rust::Slice<const uint8_t> image, rust::Str name);
std::unique_ptr<PreparedLaunch> prepare_launch(rust::Str name, rust::Slice<const KernelNode> nodes,
                                               rust::Slice<const KernelArg> args,
                                               rust::Slice<const LaunchOutput> outputs, bool commit, StreamSpec s);
VecPtr call_launch(const PreparedLaunch& launch, const ArrayVec& inputs, rust::Slice<const uint64_t> values);
GraphNode graph_node(const Array& a);
uint64_t cuda_device_address(const Array& a);
VecPtr node_inputs(const Array& a);
VecPtr node_outputs(const Array& a);

}  // namespace rmlx_shim
