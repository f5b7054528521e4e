// Rows of a bfloat16 table by index, copied as they are: the token embedding lookup of the
// JAX engine's prefill and decode steps on CPU (models/kernels/embed_rows.py).
//
// XLA:CPU has no bfloat16 gather: it converts the whole table to float32 (or, for a gather
// of its uint16 bits, copies the table through a bitcast) before gathering, and in a decode
// loop that loop-invariant copy is hoisted out of the loop and paid once per call.
//
// Buffers: table bf16 [V, D]; ids s32 [N]; out bf16 [N, D]. As jnp.take by default: an id
// in [-V, 0) counts from the end, any other outside [0, V) gives a row of NaN.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr uint16_t kBf16Nan = 0x7FC0;

ffi::Error EmbedRowsImpl(ffi::Buffer<ffi::BF16> table, ffi::Buffer<ffi::S32> ids,
                         ffi::ResultBuffer<ffi::BF16> out) {
  auto td = table.dimensions();
  if (td.size() != 2) return ffi::Error::InvalidArgument("embed_rows: the table must be 2-D");
  const int64_t V = td[0], D = td[1], N = ids.element_count();
  if (out->element_count() != N * D)
    return ffi::Error::InvalidArgument("embed_rows: mismatched shapes");
  const uint16_t* tp = table.typed_data();
  const int32_t* ip = ids.typed_data();
  uint16_t* op = out->typed_data();
  for (int64_t i = 0; i < N; ++i) {
    const int64_t id = ip[i] < 0 ? ip[i] + V : ip[i];
    if (id < 0 || id >= V)
      std::fill(op + i * D, op + (i + 1) * D, kBf16Nan);
    else
      std::memcpy(op + i * D, tp + id * D, static_cast<size_t>(D) * sizeof(uint16_t));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlEmbedRows, EmbedRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());
