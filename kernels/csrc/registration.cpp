// The ops' schemas and their CPU implementations (ops.h), one library per build: its name is
// the build's op namespace (PDSERVE_OPS), so two builds can be loaded side by side.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(PDSERVE_OPS, m) {
  using namespace PDSERVE_OPS;
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, Tensor(a!) out) -> ()");
  m.def("paged_prefill_attention(Tensor q, Tensor kv_cache, Tensor block_tables, "
        "Tensor query_start_loc, Tensor num_cached, float scale, int gemm, "
        "Tensor(a!) out) -> ()");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def("exponential_race(Tensor probs, Tensor keys, bool logits, Tensor? cut, Tensor(a!) out) "
        "-> ()");
  m.def("argmax_rows(Tensor x, Tensor(a!) out) -> ()");
  m.def("divide_rows(Tensor x, Tensor d, Tensor(a!) out) -> ()");
  m.def("silu_mul(Tensor gate, Tensor up, Tensor(a!) out) -> ()");
  m.def("rms_norm(Tensor x, Tensor(a!)? residual, Tensor weight, float eps, Tensor(b!) out) -> ()");
  m.def("rope(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("set_pool_threads(int n) -> ()");
  m.def("pool_threads() -> int");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, &paged_prefill_attention);
  m.impl("write_kv", c10::DispatchKey::CPU, &write_kv);
  m.impl("exponential_race", c10::DispatchKey::CPU, &exponential_race);
  m.impl("argmax_rows", c10::DispatchKey::CPU, &argmax_rows);
  m.impl("divide_rows", c10::DispatchKey::CPU, &divide_rows);
  m.impl("silu_mul", c10::DispatchKey::CPU, &silu_mul);
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("rope", c10::DispatchKey::CPU, &rope);
  m.impl("pack_linear_weight", c10::DispatchKey::CPU, &pack_linear_weight);
  m.impl("packed_linear", c10::DispatchKey::CPU, &packed_linear);
  // no tensor to dispatch on: for every key
  m.impl("set_pool_threads", c10::DispatchKey::CatchAll, &set_pool_threads);
  m.impl("pool_threads", c10::DispatchKey::CatchAll, &pool_threads);
}
