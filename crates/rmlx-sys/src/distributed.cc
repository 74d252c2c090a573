// The C++ side of rmlx-sys's distributed bridge (see distributed.rs).
#include "rmlx-sys/src/distributed.h"

#include <stdexcept>
#include <string>

namespace rmlx_shim {

namespace dist = mlx::core::distributed;

bool distributed_available(rust::Str backend) {
  return dist::is_available(std::string(backend));
}

std::unique_ptr<Group> distributed_init(bool strict, rust::Str backend) {
  detail::bind_thread();
  return std::make_unique<Group>(dist::init(strict, std::string(backend)));
}

int32_t group_rank(const Group& g) { return g.rank(); }

int32_t group_size(const Group& g) { return g.size(); }

std::unique_ptr<Group> group_split(const Group& g, int32_t color, int32_t key) {
  return std::make_unique<Group>(g.split(color, key));
}

ArrayPtr collective(uint8_t op, const Array& a, const Group& g, StreamSpec st) {
  detail::bind_thread();
  auto s = detail::stream_of(st);
  switch (op) {
    case 0: return std::make_unique<Array>(dist::all_sum(a, g, s));
    case 1: return std::make_unique<Array>(dist::all_gather(a, g, s));
    case 2: return std::make_unique<Array>(dist::all_max(a, g, s));
    case 3: return std::make_unique<Array>(dist::all_min(a, g, s));
    case 4: return std::make_unique<Array>(dist::sum_scatter(a, g, s));
    default: throw std::invalid_argument("unknown collective operation " + std::to_string(op));
  }
}

ArrayPtr send(const Array& a, int32_t dst, const Group& g, StreamSpec st) {
  detail::bind_thread();
  return std::make_unique<Array>(dist::send(a, dst, g, detail::stream_of(st)));
}

ArrayPtr recv(rust::Slice<const int32_t> shape, uint8_t dtype, int32_t src, const Group& g, StreamSpec st) {
  detail::bind_thread();
  mlx::core::Shape sh(shape.begin(), shape.end());
  return std::make_unique<Array>(dist::recv(sh, detail::dtype_of_code(dtype), src, g, detail::stream_of(st)));
}

}  // namespace rmlx_shim
