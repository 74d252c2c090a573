// The C++ side of rmlx-sys's distributed bridge (see distributed.rs): one MLX call each.
#pragma once

#include <memory>

#include "mlx/distributed/distributed.h"
#include "mlx/distributed/ops.h"
#include "rmlx-sys/src/lib.rs.h"

namespace rmlx_shim {

using Group = mlx::core::distributed::Group;

bool distributed_available(rust::Str backend);
std::unique_ptr<Group> distributed_init(bool strict, rust::Str backend);
int32_t group_rank(const Group& g);
int32_t group_size(const Group& g);
std::unique_ptr<Group> group_split(const Group& g, int32_t color, int32_t key);
ArrayPtr collective(uint8_t op, const Array& a, const Group& g, StreamSpec s);
ArrayPtr send(const Array& a, int32_t dst, const Group& g, StreamSpec s);
ArrayPtr recv(rust::Slice<const int32_t> shape, uint8_t dtype, int32_t src, const Group& g, StreamSpec s);

}  // namespace rmlx_shim
