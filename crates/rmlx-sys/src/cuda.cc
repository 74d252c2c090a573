// Kernels of rmlx's own on MLX's CUDA backend (see cuda.rs).
//
// This file is compiled against MLX's headers of any flavour (the CPU one included): everything it
// needs from MLX's CUDA backend, the CUDA driver and NVRTC is looked up at run time. MLX 0.32.4's
// libmlx.so exports the command encoder's methods; its allocator's `cu::malloc_async` and
// `contiguous_copy_gpu` are hidden, so they are found in the library's ELF symbol table (the same
// addresses MLX's own code calls). If anything is missing, `cuda_unavailable` says what, and rmlx
// composes MLX's operations instead. Kernels that start early (`overlap`) need MLX's exported
// `add_graph_node` and the driver's graph functions with edge data (CUDA 12.3 and later) as well:
// without them, `cuda_overlap_unavailable` says why, and launches order their kernels as before.
#include "rmlx-sys/src/cuda.h"

#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "mlx/primitives.h"
#include "rmlx-sys/src/cuda.rs.h"

namespace mx = mlx::core;

namespace rmlx_shim {
namespace {

// CUDA's `dim3` as its functions take it (three unsigned ints, by value).
struct Dim3 {
  unsigned x, y, z;
};

// The head of MLX's `cu::CudaBuffer`: a buffer's device address comes first.
struct CudaBufferHead {
  void* data;
};

// The CUDA driver's `CUDA_KERNEL_NODE_PARAMS` (its v2 layout, CUDA 12 and 13).
struct KernelNodeParams {
  void* func;
  unsigned grid_x, grid_y, grid_z;
  unsigned block_x, block_y, block_z;
  unsigned shared_bytes;
  void** params;
  void** extra;
  void* kernel;
  void* context;
};

// The CUDA driver's `CUgraphEdgeData`: a programmatic edge lets its target start once every block of
// its source has called `griddepcontrol.launch_dependents` (or ended).
struct GraphEdgeData {
  unsigned char from_port;
  unsigned char to_port;
  unsigned char type;
  unsigned char reserved[5];
};
constexpr unsigned char kPortProgrammatic = 1;  // CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
constexpr unsigned char kDependencyProgrammatic = 1;  // CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC

using CUresult = int;
using Encoder = mx::cu::CommandEncoder;

struct Api {
  std::string missing;
  // MLX's CUDA backend.
  Encoder& (*get_command_encoder)(mx::Stream);
  void (*set_input_array)(Encoder*, const mx::array&);
  void (*set_output_array)(Encoder*, const mx::array&);
  void (*add_kernel_node_raw)(Encoder*, void*, Dim3, Dim3, Dim3, unsigned, void**);
  void (*add_completed_handler)(Encoder*, std::function<void()>);
  void (*commit)(Encoder*);
  // Optional, for kernels that start early (see `overlap_reason`): MLX's graph mode, a child
  // graph added as one node, and the driver's graphs with edge data.
  std::string no_overlap;
  bool (*use_cuda_graphs)();
  void (*add_graph_node)(Encoder*, void*, const std::string&, bool);
  CUresult (*cuGraphCreate)(void**, unsigned);
  CUresult (*cuGraphDestroy)(void*);
  CUresult (*cuGraphAddKernelNode)(void**, void*, void* const*, size_t, const KernelNodeParams*);
  CUresult (*cuGraphAddDependencies)(void*, void* const*, void* const*, const GraphEdgeData*, size_t);
  CUresult (*cuGraphAddChildGraphNode)(void**, void*, void* const*, size_t, void*);
  CUresult (*cuGraphInstantiateWithFlags)(void**, void*, unsigned long long);
  CUresult (*cuGraphExecDestroy)(void*);
  mx::allocator::Data (*malloc_async)(size_t, Encoder&);
  mx::array (*contiguous_copy_gpu)(const mx::array&, const mx::Stream&);
  // The CUDA driver.
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDeviceGet)(int*, int);
  CUresult (*cuDeviceGetAttribute)(int*, int, int);
  CUresult (*cuDevicePrimaryCtxRetain)(void**, int);
  CUresult (*cuCtxPushCurrent)(void*);
  CUresult (*cuCtxPopCurrent)(void**);
  CUresult (*cuModuleLoadData)(void**, const void*);
  CUresult (*cuModuleGetFunction)(void**, void*, const char*);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  // NVRTC.
  int (*nvrtcVersion)(int*, int*);
  int (*nvrtcCreateProgram)(void**, const char*, const char*, int, const char* const*, const char* const*);
  int (*nvrtcCompileProgram)(void*, int, const char* const*);
  int (*nvrtcGetProgramLogSize)(void*, size_t*);
  int (*nvrtcGetProgramLog)(void*, char*);
  int (*nvrtcGetCUBINSize)(void*, size_t*);
  int (*nvrtcGetCUBIN)(void*, char*);
  int (*nvrtcDestroyProgram)(void**);
  const char* (*nvrtcGetErrorString)(int);
};

// The address of `name` in the loaded object `map` from its ELF symbol table (local symbols too).
std::map<std::string, void*> local_symbols(const link_map* map, const std::vector<std::string>& names) {
  std::map<std::string, void*> found;
  int fd = open(map->l_name, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return found;
  struct stat st {};
  if (fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(sizeof(Elf64_Ehdr))) {
    close(fd);
    return found;
  }
  size_t size = static_cast<size_t>(st.st_size);
  void* mapped = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (mapped == MAP_FAILED) return found;
  const auto* base = static_cast<const unsigned char*>(mapped);
  const auto* eh = reinterpret_cast<const Elf64_Ehdr*>(base);
  bool valid = std::memcmp(eh->e_ident, ELFMAG, SELFMAG) == 0 && eh->e_ident[EI_CLASS] == ELFCLASS64 &&
               eh->e_shoff + static_cast<size_t>(eh->e_shnum) * sizeof(Elf64_Shdr) <= size;
  if (valid) {
    const auto* sections = reinterpret_cast<const Elf64_Shdr*>(base + eh->e_shoff);
    for (int i = 0; i < eh->e_shnum; ++i) {
      const Elf64_Shdr& symtab = sections[i];
      if (symtab.sh_type != SHT_SYMTAB || symtab.sh_link >= eh->e_shnum) continue;
      const Elf64_Shdr& strtab = sections[symtab.sh_link];
      if (symtab.sh_offset + symtab.sh_size > size || strtab.sh_offset + strtab.sh_size > size) continue;
      const auto* syms = reinterpret_cast<const Elf64_Sym*>(base + symtab.sh_offset);
      const char* strings = reinterpret_cast<const char*>(base + strtab.sh_offset);
      size_t count = symtab.sh_size / sizeof(Elf64_Sym);
      for (size_t s = 0; s < count; ++s) {
        if (ELF64_ST_TYPE(syms[s].st_info) != STT_FUNC || syms[s].st_value == 0) continue;
        if (syms[s].st_name >= strtab.sh_size) continue;
        const char* name = strings + syms[s].st_name;
        for (auto& wanted : names) {
          if (wanted == name) found[wanted] = reinterpret_cast<void*>(map->l_addr + syms[s].st_value);
        }
      }
    }
  }
  munmap(mapped, size);
  return found;
}

void* open_library(std::initializer_list<const char*> names) {
  for (const char* name : names) {
    if (void* h = dlopen(name, RTLD_NOW | RTLD_NOLOAD)) return h;
  }
  for (const char* name : names) {
    if (void* h = dlopen(name, RTLD_NOW)) return h;
  }
  return nullptr;
}

template <typename F>
void resolve(void* handle, const char* symbol, F& slot, std::string& missing) {
  slot = handle ? reinterpret_cast<F>(dlsym(handle, symbol)) : nullptr;
  if (!slot && missing.empty()) missing = std::string("`") + symbol + "` was not found";
}

Api load_api() {
  Api api{};
  std::string& missing = api.missing;
  const char* encoder_symbol = "_ZN3mlx4core2cu19get_command_encoderENS0_6StreamE";
  void* self = dlopen(nullptr, RTLD_NOW);
  api.get_command_encoder = reinterpret_cast<decltype(api.get_command_encoder)>(dlsym(self, encoder_symbol));
  if (!api.get_command_encoder) {
    api.missing = "this MLX has no CUDA backend";
    return api;
  }
  resolve(self, "_ZN3mlx4core2cu14CommandEncoder15set_input_arrayERKNS0_5arrayE", api.set_input_array, missing);
  resolve(self, "_ZN3mlx4core2cu14CommandEncoder16set_output_arrayERKNS0_5arrayE", api.set_output_array, missing);
  resolve(self, "_ZN3mlx4core2cu14CommandEncoder19add_kernel_node_rawEP9CUfunc_st4dim3S5_S5_jPPv",
          api.add_kernel_node_raw, missing);
  resolve(self, "_ZN3mlx4core2cu14CommandEncoder21add_completed_handlerESt8functionIFvvEE",
          api.add_completed_handler, missing);
  resolve(self, "_ZN3mlx4core2cu14CommandEncoder6commitEv", api.commit, missing);
  resolve(self,
          "_ZN3mlx4core2cu14CommandEncoder14add_graph_nodeEP10CUgraph_stRKNSt7__cxx1112basic_stringIcSt11char_"
          "traitsIcESaIcEEEb",
          api.add_graph_node, api.no_overlap);

  // The hidden functions, from the symbol table of the library that defines the encoder.
  Dl_info info{};
  link_map* map = nullptr;
  if (!dladdr1(reinterpret_cast<void*>(api.get_command_encoder), &info, reinterpret_cast<void**>(&map),
               RTLD_DL_LINKMAP) ||
      map == nullptr) {
    if (missing.empty()) missing = "MLX's CUDA library could not be located";
  } else {
    const std::string malloc_name = "_ZN3mlx4core2cu12malloc_asyncEmRNS1_14CommandEncoderE";
    const std::string copy_name = "_ZN3mlx4core19contiguous_copy_gpuERKNS0_5arrayERKNS0_6StreamE";
    const std::string graphs_name = "_ZN3mlx4core2cu12_GLOBAL__N_115use_cuda_graphsEv";
    auto found = local_symbols(map, {malloc_name, copy_name, graphs_name, encoder_symbol});
    // The table must agree with the dynamic linker on an exported symbol, or the addresses are wrong.
    if (found[encoder_symbol] != reinterpret_cast<void*>(api.get_command_encoder)) {
      if (missing.empty()) missing = std::string("the symbol table of ") + map->l_name + " is unreadable";
    } else {
      api.malloc_async = reinterpret_cast<decltype(api.malloc_async)>(found[malloc_name]);
      api.contiguous_copy_gpu = reinterpret_cast<decltype(api.contiguous_copy_gpu)>(found[copy_name]);
      if (!api.malloc_async && missing.empty()) missing = "MLX's `cu::malloc_async` was not found";
      if (!api.contiguous_copy_gpu && missing.empty()) missing = "MLX's `contiguous_copy_gpu` was not found";
      api.use_cuda_graphs = reinterpret_cast<decltype(api.use_cuda_graphs)>(found[graphs_name]);
      if (!api.use_cuda_graphs && api.no_overlap.empty()) api.no_overlap = "MLX's `use_cuda_graphs` was not found";
    }
  }

  void* cuda = open_library({"libcuda.so.1", "libcuda.so"});
  if (!cuda && missing.empty()) missing = "the CUDA driver (libcuda.so.1) could not be loaded";
  resolve(cuda, "cuInit", api.cuInit, missing);
  resolve(cuda, "cuDeviceGet", api.cuDeviceGet, missing);
  resolve(cuda, "cuDeviceGetAttribute", api.cuDeviceGetAttribute, missing);
  resolve(cuda, "cuDevicePrimaryCtxRetain", api.cuDevicePrimaryCtxRetain, missing);
  resolve(cuda, "cuCtxPushCurrent_v2", api.cuCtxPushCurrent, missing);
  resolve(cuda, "cuCtxPopCurrent_v2", api.cuCtxPopCurrent, missing);
  resolve(cuda, "cuModuleLoadData", api.cuModuleLoadData, missing);
  resolve(cuda, "cuModuleGetFunction", api.cuModuleGetFunction, missing);
  resolve(cuda, "cuGetErrorString", api.cuGetErrorString, missing);
  resolve(cuda, "cuGraphCreate", api.cuGraphCreate, api.no_overlap);
  resolve(cuda, "cuGraphDestroy", api.cuGraphDestroy, api.no_overlap);
  resolve(cuda, "cuGraphAddKernelNode_v2", api.cuGraphAddKernelNode, api.no_overlap);
  resolve(cuda, "cuGraphAddDependencies_v2", api.cuGraphAddDependencies, api.no_overlap);
  resolve(cuda, "cuGraphAddChildGraphNode", api.cuGraphAddChildGraphNode, api.no_overlap);
  resolve(cuda, "cuGraphInstantiateWithFlags", api.cuGraphInstantiateWithFlags, api.no_overlap);
  resolve(cuda, "cuGraphExecDestroy", api.cuGraphExecDestroy, api.no_overlap);

  void* nvrtc = open_library({"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"});
  if (!nvrtc && missing.empty()) missing = "NVRTC (libnvrtc.so) could not be loaded";
  resolve(nvrtc, "nvrtcVersion", api.nvrtcVersion, missing);
  resolve(nvrtc, "nvrtcCreateProgram", api.nvrtcCreateProgram, missing);
  resolve(nvrtc, "nvrtcCompileProgram", api.nvrtcCompileProgram, missing);
  resolve(nvrtc, "nvrtcGetProgramLogSize", api.nvrtcGetProgramLogSize, missing);
  resolve(nvrtc, "nvrtcGetProgramLog", api.nvrtcGetProgramLog, missing);
  resolve(nvrtc, "nvrtcGetCUBINSize", api.nvrtcGetCUBINSize, missing);
  resolve(nvrtc, "nvrtcGetCUBIN", api.nvrtcGetCUBIN, missing);
  resolve(nvrtc, "nvrtcDestroyProgram", api.nvrtcDestroyProgram, missing);
  resolve(nvrtc, "nvrtcGetErrorString", api.nvrtcGetErrorString, missing);
  if (missing.empty() && api.cuInit(0) != 0) missing = "the CUDA driver failed to initialise";
  return api;
}

const Api& api() {
  static const Api loaded = load_api();
  return loaded;
}

const Api& usable_api() {
  const Api& a = api();
  if (!a.missing.empty()) throw std::runtime_error("rmlx's CUDA kernels cannot run: " + a.missing);
  return a;
}

void check_cuda(CUresult r, const char* what) {
  if (r == 0) return;
  const char* message = nullptr;
  api().cuGetErrorString(r, &message);
  throw std::runtime_error(std::string(what) + " failed: " + (message ? message : std::to_string(r)));
}

void check_nvrtc(int r, const char* what) {
  if (r != 0) throw std::runtime_error(std::string(what) + " failed: " + api().nvrtcGetErrorString(r));
}

void* device_address(const mx::array& a) {
  auto* buffer = static_cast<const CudaBufferHead*>(a.buffer().ptr());
  return static_cast<char*>(buffer->data) + a.offset();
}

// A graph of `nodes`, each after the one before: after a programmatic edge where the node is marked
// `overlap` (it starts once every block of the node before has called `launch_dependents` or
// ended, and waits for that node's end itself), after a plain one otherwise. The caller destroys it.
void* chain_graph(const Api& a, const std::vector<KernelNode>& nodes, void** params) {
  void* graph = nullptr;
  check_cuda(a.cuGraphCreate(&graph, 0), "cuGraphCreate");
  std::unique_ptr<void, void (*)(void*)> owner(graph, [](void* g) { api().cuGraphDestroy(g); });
  void* previous = nullptr;
  for (size_t n = 0; n < nodes.size(); ++n) {
    const KernelNode& node = nodes[n];
    KernelNodeParams p{};
    p.func = reinterpret_cast<void*>(node.function);
    p.grid_x = node.grid[0], p.grid_y = node.grid[1], p.grid_z = node.grid[2];
    p.block_x = node.block[0], p.block_y = node.block[1], p.block_z = node.block[2];
    p.shared_bytes = node.shared_bytes;
    p.params = params + node.first_arg;
    void* added = nullptr;
    check_cuda(a.cuGraphAddKernelNode(&added, graph, nullptr, 0, &p), "cuGraphAddKernelNode");
    if (n > 0) {
      GraphEdgeData edge{};
      if (node.overlap) {
        edge.from_port = kPortProgrammatic;
        edge.type = kDependencyProgrammatic;
      }
      check_cuda(a.cuGraphAddDependencies(graph, &previous, &added, &edge, 1), "cuGraphAddDependencies");
    }
    previous = added;
  }
  return owner.release();
}

// Whether this driver runs a graph with a programmatic edge as a child of another: two nodes of an
// empty kernel (from PTX) so chained, made a child graph and instantiated. Empty if it does.
std::string probe_child_chain(const Api& a, int device) {
  static const char* kPtx =
      ".version 7.8\n.target sm_90\n.address_size 64\n.visible .entry rmlx_probe()\n{\n  ret;\n}\n";
  std::string why;
  bool pushed = false;
  void* parent = nullptr;
  void* exec = nullptr;
  try {
    int dev = 0;
    void* context = nullptr;
    check_cuda(a.cuDeviceGet(&dev, device), "cuDeviceGet");
    check_cuda(a.cuDevicePrimaryCtxRetain(&context, dev), "cuDevicePrimaryCtxRetain");
    check_cuda(a.cuCtxPushCurrent(context), "cuCtxPushCurrent");
    pushed = true;
    void* module = nullptr;
    void* function = nullptr;
    check_cuda(a.cuModuleLoadData(&module, kPtx), "cuModuleLoadData (probe)");
    check_cuda(a.cuModuleGetFunction(&function, module, "rmlx_probe"), "cuModuleGetFunction (probe)");
    KernelNode node{};
    node.function = reinterpret_cast<uint64_t>(function);
    node.grid = {1, 1, 1};
    node.block = {32, 1, 1};
    node.overlap = true;
    std::vector<KernelNode> nodes{node, node};
    void* child = chain_graph(a, nodes, nullptr);
    std::unique_ptr<void, void (*)(void*)> owner(child, [](void* g) { api().cuGraphDestroy(g); });
    check_cuda(a.cuGraphCreate(&parent, 0), "cuGraphCreate");
    void* added = nullptr;
    check_cuda(a.cuGraphAddChildGraphNode(&added, parent, nullptr, 0, child), "cuGraphAddChildGraphNode");
    check_cuda(a.cuGraphInstantiateWithFlags(&exec, parent, 0), "cuGraphInstantiateWithFlags");
  } catch (const std::exception& e) {
    why = std::string("CUDA graphs refuse kernels chained by programmatic edges in a child graph: ") + e.what();
  }
  if (exec) a.cuGraphExecDestroy(exec);
  if (parent) a.cuGraphDestroy(parent);
  void* popped = nullptr;
  if (pushed) a.cuCtxPopCurrent(&popped);
  return why;
}

// Why kernels marked `overlap` cannot start early on CUDA device `device` (empty: they can).
const std::string& overlap_reason(int device) {
  static std::mutex lock;
  static std::map<int, std::string> reasons;
  std::lock_guard<std::mutex> guard(lock);
  auto it = reasons.find(device);
  if (it != reasons.end()) return it->second;
  const Api& a = api();
  std::string why = !a.missing.empty() ? a.missing : a.no_overlap;
  if (why.empty() && !a.use_cuda_graphs()) why = "MLX launches kernels without CUDA graphs (MLX_USE_CUDA_GRAPHS)";
  if (why.empty()) {
    // Never throws: the bridge's `cuda_overlap_unavailable` returns the reason as a string.
    try {
      int dev = 0, major = 0;
      check_cuda(a.cuDeviceGet(&dev, device), "cuDeviceGet");
      check_cuda(a.cuDeviceGetAttribute(&major, 75, dev), "cuDeviceGetAttribute");
      if (major < 9) {
        why = "programmatic dependent launch needs compute capability 9.0 (this GPU: " + std::to_string(major) + ".x)";
      }
    } catch (const std::exception& e) {
      why = e.what();
    }
  }
  if (why.empty()) why = probe_child_chain(a, device);
  return reasons.emplace(device, why).first->second;
}

// What a launch runs, shared by the primitive made once and its copies made per call.
struct LaunchSpec {
  std::string name;
  std::vector<KernelNode> nodes;
  std::vector<KernelArg> args;
  std::vector<int> aliases;
  std::vector<bool> owned;
  // Launch MLX's graph so far, this launch's kernels last, before any later operation is added.
  bool commit = false;
};

// Kernel nodes of rmlx's own added to MLX's CUDA graph; inputs are made row-contiguous first.
class CudaLaunch : public mx::Primitive {
 public:
  CudaLaunch(mx::Stream stream, std::shared_ptr<const LaunchSpec> spec)
      : mx::Primitive(stream), spec_(std::move(spec)) {}

  void eval_cpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[" + spec_->name + "] runs only on MLX's CUDA backend");
  }

  // The same launch whose kind-4 arguments are `values` (one call's).
  std::shared_ptr<CudaLaunch> with_call_values(std::vector<uint64_t> values) {
    auto launch = std::make_shared<CudaLaunch>(stream(), spec_);
    launch->call_values_ = std::move(values);
    return launch;
  }

  const LaunchSpec& spec() const { return *spec_; }
  const std::vector<uint64_t>& call_values() const { return call_values_; }

  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const Api& a = usable_api();
    const LaunchSpec& spec = *spec_;
    Encoder& encoder = a.get_command_encoder(stream());
    std::vector<mx::array> copies;
    copies.reserve(inputs.size() + outputs.size());
    std::vector<const mx::array*> ins;
    for (auto& in : inputs) {
      if (in.flags().row_contiguous) {
        ins.push_back(&in);
      } else {
        copies.push_back(a.contiguous_copy_gpu(in, stream()));
        ins.push_back(&copies.back());
      }
    }
    for (size_t j = 0; j < outputs.size(); ++j) {
      auto& out = outputs[j];
      int alias = spec.aliases[j];
      if (alias < 0) {
        out.set_data(a.malloc_async(out.nbytes(), encoder));
      } else if (inputs.at(alias).dtype() != out.dtype() || inputs[alias].size() != out.size()) {
        throw std::invalid_argument("[" + spec.name + "] an output updated in place differs from its input");
      } else if ((spec.owned[j] || inputs[alias].is_donatable()) && ins[alias] == &inputs[alias]) {
        out.copy_shared_buffer(inputs[alias]);
      } else {
        // Someone else may still read the input, or it was copied to be row-contiguous: the
        // kernels update a copy of it.
        copies.push_back(a.contiguous_copy_gpu(*ins[alias], stream()));
        out.copy_shared_buffer(copies.back());
      }
    }
    for (auto* in : ins) a.set_input_array(&encoder, *in);
    for (auto& out : outputs) a.set_output_array(&encoder, out);
    std::vector<uint64_t> values(spec.args.size());
    std::vector<void*> params(spec.args.size());
    for (size_t i = 0; i < spec.args.size(); ++i) {
      const KernelArg& arg = spec.args[i];
      switch (arg.kind) {
        case 0: values[i] = reinterpret_cast<uint64_t>(device_address(*ins.at(arg.index))); break;
        case 1: values[i] = reinterpret_cast<uint64_t>(device_address(outputs.at(arg.index))); break;
        case 4: values[i] = call_values_.at(arg.index); break;
        default: values[i] = arg.bits; break;
      }
      params[i] = &values[i];
    }
    if (overlaps(spec) && overlap_reason(stream().device.index).empty()) {
      add_chained_nodes(a, encoder, spec, params);
    } else {
      add_ordered_nodes(a, encoder, spec, params, outputs);
    }
    if (!copies.empty()) {
      // The copies live until the graph that reads them has run.
      a.add_completed_handler(&encoder, [copies = std::move(copies)]() {});
    }
    if (spec.commit) a.commit(&encoder);
  }

  // Whether any node after the first may start before the one before it ends.
  static bool overlaps(const LaunchSpec& spec) {
    for (size_t n = 1; n < spec.nodes.size(); ++n) {
      if (spec.nodes[n].overlap) return true;
    }
    return false;
  }

  static Dim3 dim(const std::array<uint32_t, 3>& d) { return Dim3{d[0], d[1], d[2]}; }

  // The nodes in order, each ordered after the one before by MLX's encoder: a middle node
  // declares the first output (MLX orders a node after the producers of the arrays declared since
  // the previous node and records it as the producer of the outputs declared), the last one every
  // output (so that later readers of any output wait for the whole launch).
  static void add_ordered_nodes(const Api& a, Encoder& encoder, const LaunchSpec& spec, std::vector<void*>& params,
                                std::vector<mx::array>& outputs) {
    size_t last = spec.nodes.size() - 1;
    for (size_t n = 0; n < spec.nodes.size(); ++n) {
      const KernelNode& node = spec.nodes[n];
      if (n > 0 && n < last) {
        a.set_output_array(&encoder, outputs[0]);
      } else if (n > 0) {
        for (auto& out : outputs) a.set_output_array(&encoder, out);
      }
      a.add_kernel_node_raw(&encoder, reinterpret_cast<void*>(node.function), dim(node.grid), dim(node.block),
                            Dim3{1, 1, 1}, node.shared_bytes, params.data() + node.first_arg);
    }
  }

  // The nodes as one child graph of rmlx's own (`chain_graph`), added to MLX's graph as one node
  // after the producers of every input and output declared before, and recorded as their producer.
  static void add_chained_nodes(const Api& a, Encoder& encoder, const LaunchSpec& spec, std::vector<void*>& params) {
    void* graph = chain_graph(a, spec.nodes, params.data());
    std::unique_ptr<void, void (*)(void*)> owner(graph, [](void* g) { api().cuGraphDestroy(g); });
    // MLX keys its executable graphs by their nodes': one key a launch (its spec lives as long).
    std::string key = "(rmlx" + std::to_string(reinterpret_cast<uintptr_t>(&spec)) + ")";
    a.add_graph_node(&encoder, graph, key, true);
  }

  const char* name() const override { return spec_->name.c_str(); }

 private:
  std::shared_ptr<const LaunchSpec> spec_;
  std::vector<uint64_t> call_values_;
};

}  // namespace

rust::String cuda_unavailable() { return rust::String(api().missing); }

rust::String cuda_overlap_unavailable(int32_t device) { return rust::String(overlap_reason(device)); }

int32_t cuda_compute_capability(int32_t device) {
  const Api& a = usable_api();
  int dev = 0, major = 0, minor = 0;
  check_cuda(a.cuDeviceGet(&dev, device), "cuDeviceGet");
  check_cuda(a.cuDeviceGetAttribute(&major, 75, dev), "cuDeviceGetAttribute");
  check_cuda(a.cuDeviceGetAttribute(&minor, 76, dev), "cuDeviceGetAttribute");
  return major * 10 + minor;
}

int32_t cuda_multiprocessors(int32_t device) {
  const Api& a = usable_api();
  int dev = 0, count = 0;
  check_cuda(a.cuDeviceGet(&dev, device), "cuDeviceGet");
  // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
  check_cuda(a.cuDeviceGetAttribute(&count, 16, dev), "cuDeviceGetAttribute");
  return count;
}

int32_t nvrtc_version() {
  const Api& a = usable_api();
  int major = 0, minor = 0;
  check_nvrtc(a.nvrtcVersion(&major, &minor), "nvrtcVersion");
  return major * 1000 + minor * 10;
}

rust::Vec<uint8_t> nvrtc_compile(rust::Str source, rust::Str name, int32_t arch) {
  const Api& a = usable_api();
  std::string src(source), file(name);
  void* program = nullptr;
  check_nvrtc(a.nvrtcCreateProgram(&program, src.c_str(), file.c_str(), 0, nullptr, nullptr), "nvrtcCreateProgram");
  std::unique_ptr<void*, void (*)(void**)> owner(&program, [](void** p) { api().nvrtcDestroyProgram(p); });
  std::string gpu = "--gpu-architecture=sm_" + std::to_string(arch) + (arch >= 90 ? "a" : "");
  const char* options[] = {gpu.c_str(), "--std=c++17"};
  int compiled = a.nvrtcCompileProgram(program, 2, options);
  if (compiled != 0) {
    size_t size = 0;
    a.nvrtcGetProgramLogSize(program, &size);
    std::string log(size, '\0');
    if (size > 0) a.nvrtcGetProgramLog(program, log.data());
    throw std::runtime_error("NVRTC could not compile " + file + ": " + log.c_str());
  }
  size_t size = 0;
  check_nvrtc(a.nvrtcGetCUBINSize(program, &size), "nvrtcGetCUBINSize");
  std::string cubin(size, '\0');
  check_nvrtc(a.nvrtcGetCUBIN(program, cubin.data()), "nvrtcGetCUBIN");
  rust::Vec<uint8_t> out;
  out.reserve(size);
  for (char c : cubin) out.push_back(static_cast<uint8_t>(c));
  return out;
}

uint64_t cuda_load_function(int32_t device, rust::Slice<const uint8_t> image, rust::Str name) {
  const Api& a = usable_api();
  int dev = 0;
  void* context = nullptr;
  check_cuda(a.cuDeviceGet(&dev, device), "cuDeviceGet");
  check_cuda(a.cuDevicePrimaryCtxRetain(&context, dev), "cuDevicePrimaryCtxRetain");
  check_cuda(a.cuCtxPushCurrent(context), "cuCtxPushCurrent");
  std::string function(name);
  void* module = nullptr;
  void* kernel = nullptr;
  CUresult loaded = a.cuModuleLoadData(&module, image.data());
  CUresult got = loaded == 0 ? a.cuModuleGetFunction(&kernel, module, function.c_str()) : 0;
  void* popped = nullptr;
  a.cuCtxPopCurrent(&popped);
  check_cuda(loaded, "cuModuleLoadData");
  check_cuda(got, ("cuModuleGetFunction(" + function + ")").c_str());
  return reinterpret_cast<uint64_t>(kernel);
}

std::unique_ptr<PreparedLaunch> prepare_launch(rust::Str name, rust::Slice<const KernelNode> nodes,
                                               rust::Slice<const KernelArg> args,
                                               rust::Slice<const LaunchOutput> outputs, bool commit, StreamSpec s) {
  usable_api();
  if (nodes.empty()) throw std::invalid_argument("a launch has no kernel nodes");
  for (auto& node : nodes) {
    if (node.function == 0) throw std::invalid_argument("a kernel node has no function");
    if (static_cast<size_t>(node.first_arg) + node.arg_count > args.size()) {
      throw std::invalid_argument("a kernel node's arguments lie past the argument list");
    }
  }
  for (auto& arg : args) {
    if (arg.kind == 1 && arg.index >= outputs.size()) throw std::invalid_argument("an argument names a missing output");
    if (arg.kind > 4) throw std::invalid_argument("unknown kernel argument kind");
  }
  auto stream = mx::to_stream(detail::stream_of(s));
  auto launch = std::make_unique<PreparedLaunch>();
  auto spec = std::make_shared<LaunchSpec>();
  spec->name = std::string(name);
  spec->nodes.assign(nodes.begin(), nodes.end());
  spec->args.assign(args.begin(), args.end());
  spec->commit = commit;
  for (auto& o : outputs) {
    launch->shapes.emplace_back(o.shape.begin(), o.shape.end());
    launch->dtypes.push_back(detail::dtype_of_code(o.dtype));
    spec->aliases.push_back(o.alias);
    spec->owned.push_back(o.owned);
  }
  launch->primitive = std::make_shared<CudaLaunch>(stream, std::move(spec));
  return launch;
}

VecPtr call_launch(const PreparedLaunch& launch, const ArrayVec& inputs, rust::Slice<const uint64_t> values) {
  std::shared_ptr<mx::Primitive> primitive = launch.primitive;
  if (!values.empty()) {
    // prepare_launch makes every PreparedLaunch's primitive a CudaLaunch.
    auto& prototype = static_cast<CudaLaunch&>(*launch.primitive);
    primitive = prototype.with_call_values(std::vector<uint64_t>(values.begin(), values.end()));
  }
  return std::make_unique<ArrayVec>(mx::array::make_arrays(launch.shapes, launch.dtypes, primitive, inputs));
}

GraphNode graph_node(const Array& a) {
  GraphNode node;
  node.kind = 0;
  node.output = 0;
  if (!a.has_primitive() || a.is_available()) return node;
  const mx::Primitive& primitive = a.primitive();
  node.name = rust::String(primitive.name());
  auto outputs = a.outputs();
  for (size_t j = 0; j < outputs.size(); ++j) {
    if (outputs[j].id() == a.id()) node.output = static_cast<int32_t>(j);
  }
  if (auto* launch = dynamic_cast<const CudaLaunch*>(&primitive)) {
    const LaunchSpec& spec = launch->spec();
    node.kind = 1;
    for (auto& n : spec.nodes) node.nodes.push_back(n);
    for (auto& arg : spec.args) node.args.push_back(arg);
    for (int alias : spec.aliases) node.aliases.push_back(alias);
    for (bool owned : spec.owned) node.owned.push_back(owned);
    for (uint64_t v : launch->call_values()) node.values.push_back(v);
  } else if (std::string(primitive.name()) == "Reshape") {
    node.kind = 2;
  } else {
    node.kind = 3;
  }
  return node;
}

uint64_t cuda_device_address(const Array& a) {
  usable_api();
  if (a.status() == mx::array::Status::unscheduled || a.buffer().ptr() == nullptr) {
    throw std::invalid_argument("the device address of an array not evaluated");
  }
  return reinterpret_cast<uint64_t>(device_address(a));
}

VecPtr node_inputs(const Array& a) { return std::make_unique<ArrayVec>(a.inputs()); }

VecPtr node_outputs(const Array& a) {
  if (!a.has_primitive()) return std::make_unique<ArrayVec>(ArrayVec{a});
  return std::make_unique<ArrayVec>(a.outputs());
}

}  // namespace rmlx_shim
