// pybind11 bindings of the fused loss and the CPU decode attention: the only place where Python meets
// the core.
//
// flashreinforce/ops/fused.py validates every argument of the objective (with the rules of
// flashreinforce/ops/contract.py, shared with the pure-PyTorch reference), allocates the outputs
// and calls loss_forward(views, options, launch) with three dicts:
//   views:   name -> (data_ptr: int, numel: int, dtype: str) or None, one per LossParams view
//            (log_probs, ..., retained_tokens) plus "workspace" (CUDA) and "error_record";
//   options: the LossOptions fields by name, read through the core's field table (core.h,
//            kLossOptionFields: optional values may be None, enums are given by name); this file
//            names no option;
//   launch:  device ("cpu" or "cuda"), padded_row_length (0: packed form), num_threads, stream,
//            synchronize (CUDA: wait and return the error record).
// Views are contiguous by construction (fused.py passes contiguous tensors). The only checks
// here are the structural ones the core needs for memory safety (check_params), raised as
// RuntimeError: the public entry points never reach them. Errors found during the pass come back
// as (code, index); fused.py turns them into exceptions with the contract's messages. No PyTorch
// header is included, so one build serves any PyTorch release.
#include <pybind11/pybind11.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "flashreinforce/core.h"
#include "flashreinforce/decode_attention.h"
#include "flashreinforce/decode_step.h"
#include "flashreinforce/layer_glue.h"
#include "flashreinforce/skinny_gemm.h"

namespace py = pybind11;
using namespace flashreinforce;

namespace flashreinforce {
namespace cpu {
const char* cpu_isa_name();
bool cpu_uses_avx512_bf16();
}
}  // namespace flashreinforce

namespace {

// The views of LossParams by name: the one place that maps the Python names to the struct.
struct ViewField {
  const char* name;
  TensorView LossParams::*member;
};
constexpr ViewField kViewFields[] = {
    {"log_probs", &LossParams::log_probs},
    {"behavior_log_probs", &LossParams::behavior_log_probs},
    {"rewards", &LossParams::rewards},
    {"cu_seqlens", &LossParams::cu_seqlens},
    {"action_mask", &LossParams::action_mask},
    {"entropies", &LossParams::entropies},
    {"failures", &LossParams::failures},
    {"loss", &LossParams::loss},
    {"grad", &LossParams::grad},
    {"advantages", &LossParams::advantages},
    {"sequence_kl", &LossParams::sequence_kl},
    {"admitted", &LossParams::admitted},
    {"acceptance_rate", &LossParams::acceptance_rate},
    {"policy_tokens", &LossParams::policy_tokens},
    {"retained_tokens", &LossParams::retained_tokens},
};

[[noreturn]] void invalid(const std::string& what) {
  throw std::runtime_error("flashreinforce._C.loss_forward: " + what);
}

bool find_dtype(const std::string& name, DType& out) {
  for (int d = 0; d < kNumDTypes; ++d) {
    if (name == dtype_name(static_cast<DType>(d))) {
      out = static_cast<DType>(d);
      return true;
    }
  }
  return false;
}

DType dtype_from_name(const std::string& name) {
  DType d;
  if (!find_dtype(name, d)) invalid("unsupported dtype '" + name + "'");
  return d;
}

TensorView view_of(const char* name, py::handle obj) {
  TensorView v;
  if (obj.is_none()) return v;
  const auto t = py::reinterpret_borrow<py::tuple>(obj);
  if (t.size() != 3) invalid(std::string(name) + ": a view is (data_ptr, numel, dtype)");
  v.data = reinterpret_cast<void*>(t[0].cast<uintptr_t>());
  v.numel = t[1].cast<int64_t>();
  v.dtype = dtype_from_name(t[2].cast<std::string>());
  if (v.data == nullptr && v.numel > 0) invalid(std::string(name) + ": null data pointer");
  return v;
}

// Fills LossOptions from a mapping of its fields by name through the core's field table (core.h,
// kLossOptionFields): every field is required, and no other key is accepted.
void fill_options(const py::dict& options, LossOptions& o) {
  char* const base = reinterpret_cast<char*>(&o);
  for (const OptionField& f : kLossOptionFields) {
    if (!options.contains(f.name)) invalid(std::string("options: missing '") + f.name + "'");
    const py::object value = options[f.name];
    char* const at = base + f.offset;
    switch (f.kind) {
      case OptionKind::kReal: {
        const double v = value.cast<double>();
        if (f.minimum > -std::numeric_limits<double>::infinity() && !(v >= f.minimum)) {
          invalid(std::string(f.name) + " must be >= " + std::to_string(f.minimum));
        }
        std::memcpy(at, &v, sizeof v);
        break;
      }
      case OptionKind::kOptionalReal: {
        const bool given = !value.is_none();
        const double v = given ? value.cast<double>() : 0.0;
        std::memcpy(at, &v, sizeof v);
        if (f.given_offset != kNoMember) std::memcpy(base + f.given_offset, &given, sizeof given);
        break;
      }
      case OptionKind::kCount: {
        const int64_t v = value.is_none() ? 0 : value.cast<int64_t>();
        std::memcpy(at, &v, sizeof v);
        break;
      }
      case OptionKind::kFlag: {
        const bool v = value.cast<bool>();
        std::memcpy(at, &v, sizeof v);
        break;
      }
      case OptionKind::kChoice: {
        const std::string name = value.cast<std::string>();
        int32_t k = 0;
        while (k < f.num_choices && name != f.choices[k]) ++k;
        if (k == f.num_choices) invalid(std::string("unknown ") + f.name + " '" + name + "'");
        std::memcpy(at, &k, sizeof k);
        break;
      }
    }
  }
  if (options.size() != static_cast<size_t>(kNumLossOptionFields)) {
    for (auto item : options) {
      const std::string key = item.first.cast<std::string>();
      bool known = false;
      for (const OptionField& f : kLossOptionFields) known = known || key == f.name;
      if (!known) invalid("unknown option '" + key + "'");
    }
  }
}

// Fills params (once) from the three dicts; returns the workspace and error-record views.
void fill(const py::dict& views, const py::dict& options, const py::dict& launch, LossParams& p,
          TensorView& workspace, TensorView& error_record) {
  for (auto item : views) {
    const std::string key = item.first.cast<std::string>();
    if (key == "workspace") {
      workspace = view_of("workspace", item.second);
      continue;
    }
    if (key == "error_record") {
      error_record = view_of("error_record", item.second);
      continue;
    }
    bool known = false;
    for (const ViewField& f : kViewFields) {
      if (key == f.name) {
        p.*(f.member) = view_of(f.name, item.second);
        known = true;
        break;
      }
    }
    if (!known) invalid("unknown view '" + key + "'");
  }
  fill_options(options, p.options);
  p.padded_row_length = launch["padded_row_length"].cast<int64_t>();
  if (const char* problem = check_params(p)) invalid(problem);
  if (!error_record.present() || error_record.dtype != DType::kInt64 || error_record.numel != 2) {
    invalid("error_record: an int64 view of 2 elements is required");
  }
}

py::tuple loss_forward(const py::dict& views, const py::dict& options, const py::dict& launch) {
  LossParams p;
  TensorView workspace, error_record;
  fill(views, options, launch, p, workspace, error_record);
  const std::string device = launch["device"].cast<std::string>();
  const bool synchronize = launch["synchronize"].cast<bool>();
  Error e;
  if (device == "cuda") {
    if (!has_cuda()) {
      throw std::runtime_error(
          "flashreinforce._C was built without CUDA, but the inputs are CUDA tensors; reinstall with a CUDA "
          "compiler available (FLASHREINFORCE_CUDA=ON) or move the inputs to the CPU");
    }
    const size_t need = cuda_workspace_bytes(p.num_tokens(), p.batch(), p.options.filter());
    if (!workspace.present() || static_cast<size_t>(workspace.numel) * dtype_size(workspace.dtype) < need) {
      invalid("workspace: missing or smaller than cuda_workspace_bytes()");
    }
    const uintptr_t stream = launch["stream"].cast<uintptr_t>();
    py::gil_scoped_release release;
    e = loss_forward_cuda(p, workspace.data, error_record.as<int64_t>(), reinterpret_cast<void*>(stream),
                          synchronize);
  } else if (device == "cpu") {
    const int num_threads = launch["num_threads"].cast<int>();
    {
      py::gil_scoped_release release;
      e = loss_forward_cpu(p, num_threads);
    }
    int64_t* record = error_record.as<int64_t>();
    record[0] = static_cast<int64_t>(e.code);
    record[1] = e.index;
  } else {
    invalid("device must be 'cpu' or 'cuda', got '" + device + "'");
  }
  return py::make_tuple(static_cast<int>(e.code), e.index);
}

// The compiled core's check of p, raised as ValueError naming the function; then the computation,
// without the GIL.
template <class P>
void run_checked(const P& p, const char* (*check)(const P&), void (*run)(const P&, int), const char* name,
                 int num_threads) {
  const std::string problem = check(p);
  if (!problem.empty()) throw py::value_error(std::string("flashreinforce._C.") + name + ": " + problem);
  py::gil_scoped_release release;
  run(p, num_threads);
}

// decode_attention(args): flashreinforce/engines/hf/decode_attention.py validates the tensors (device,
// dtypes, shapes, extents) and passes one dict: dtype (str), the sizes batch, kv_heads, groups,
// head_dim, length, scale, num_threads, the pointers q, k, v, mask, out (int), and the element
// strides q_strides (batch, head, group), k_strides and v_strides (batch, head, position) and
// mask_stride_batch. The core's structural check (decode_attention_check) is raised as
// ValueError naming the field; the computation runs without the GIL.
void decode_attention(const py::dict& args) {
  DecodeAttentionParams p;
  const std::string dtype = args["dtype"].cast<std::string>();
  if (!find_dtype(dtype, p.dtype)) throw py::value_error("flashreinforce._C.decode_attention: unknown dtype " + dtype);
  p.batch = args["batch"].cast<int64_t>();
  p.kv_heads = args["kv_heads"].cast<int64_t>();
  p.groups = args["groups"].cast<int64_t>();
  p.head_dim = args["head_dim"].cast<int64_t>();
  p.length = args["length"].cast<int64_t>();
  p.scale = args["scale"].cast<float>();
  const auto ptr = [&](const char* name) { return reinterpret_cast<void*>(args[name].cast<uintptr_t>()); };
  p.q = ptr("q");
  p.k = ptr("k");
  p.v = ptr("v");
  p.mask = static_cast<const uint8_t*>(ptr("mask"));
  p.out = ptr("out");
  const auto strides = [&](const char* name) {
    const auto t = args[name].cast<py::tuple>();
    if (t.size() != 3) {
      throw py::value_error(std::string("flashreinforce._C.decode_attention: ") + name + " needs 3 strides");
    }
    return std::array<int64_t, 3>{t[0].cast<int64_t>(), t[1].cast<int64_t>(), t[2].cast<int64_t>()};
  };
  const auto qs = strides("q_strides"), ks = strides("k_strides"), vs = strides("v_strides");
  p.q_stride_batch = qs[0], p.q_stride_head = qs[1], p.q_stride_group = qs[2];
  p.k_stride_batch = ks[0], p.k_stride_head = ks[1], p.k_stride_pos = ks[2];
  p.v_stride_batch = vs[0], p.v_stride_head = vs[1], p.v_stride_pos = vs[2];
  p.mask_stride_batch = args["mask_stride_batch"].cast<int64_t>();
  const int num_threads = args["num_threads"].cast<int>();
  run_checked(p, &decode_attention_check, &decode_attention_cpu, "decode_attention", num_threads);
}

// The decode step's small operations (flashreinforce/decode_step.h), called once per layer and step
// by flashreinforce/engines/hf/fast_decode.py, which passes checked tensors: positional arguments (a dict
// per call would cost more than some of the operations), pointers as integers, element strides. The
// core's check is raised as ValueError; the computation runs without the GIL.
DType step_dtype(const std::string& name, const char* fn) {
  DType dt;
  if (!find_dtype(name, dt)) throw py::value_error(std::string("flashreinforce._C.") + fn + ": unknown dtype " + name);
  return dt;
}

const void* as_ptr(uintptr_t value) { return reinterpret_cast<const void*>(value); }

void decode_norm(const std::string& dtype, int64_t rows, int64_t hidden, uintptr_t x, int64_t x_stride,
                 uintptr_t update, int64_t update_stride, uintptr_t weight, uintptr_t out, int64_t out_stride, float eps,
                 int num_threads) {
  DecodeNormParams p;
  p.dtype = step_dtype(dtype, "decode_norm");
  p.rows = rows, p.hidden = hidden, p.x = const_cast<void*>(as_ptr(x)), p.x_stride = x_stride;
  p.update = update ? as_ptr(update) : nullptr, p.update_stride = update_stride, p.weight = as_ptr(weight);
  p.out = const_cast<void*>(as_ptr(out)), p.out_stride = out_stride, p.eps = eps;
  run_checked(p, &decode_norm_check, &decode_norm_cpu, "decode_norm", num_threads);
}

void decode_rotary(const std::string& dtype, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                   uintptr_t qkv, int64_t qkv_stride, uintptr_t cos, uintptr_t sin, int64_t cs_stride, uintptr_t q_out,
                   uintptr_t k_slot, int64_t k_stride_batch, int64_t k_stride_head, uintptr_t v_slot,
                   int64_t v_stride_batch, int64_t v_stride_head, int num_threads) {
  DecodeRotaryParams p;
  p.dtype = step_dtype(dtype, "decode_rotary");
  p.batch = batch, p.heads = heads, p.kv_heads = kv_heads, p.head_dim = head_dim;
  p.qkv = as_ptr(qkv), p.qkv_stride = qkv_stride, p.cos = as_ptr(cos), p.sin = as_ptr(sin), p.cs_stride = cs_stride;
  p.q_out = const_cast<void*>(as_ptr(q_out));
  p.k_slot = const_cast<void*>(as_ptr(k_slot)), p.k_stride_batch = k_stride_batch, p.k_stride_head = k_stride_head;
  p.v_slot = const_cast<void*>(as_ptr(v_slot)), p.v_stride_batch = v_stride_batch, p.v_stride_head = v_stride_head;
  run_checked(p, &decode_rotary_check, &decode_rotary_cpu, "decode_rotary", num_threads);
}

void decode_silu_mul(const std::string& dtype, int64_t rows, int64_t width, uintptr_t gate_up, int64_t stride,
                     uintptr_t out, int64_t out_stride, int num_threads) {
  DecodeSiluMulParams p;
  p.dtype = step_dtype(dtype, "decode_silu_mul");
  p.rows = rows, p.width = width, p.gate_up = as_ptr(gate_up), p.stride = stride;
  p.out = const_cast<void*>(as_ptr(out)), p.out_stride = out_stride;
  run_checked(p, &decode_silu_mul_check, &decode_silu_mul_cpu, "decode_silu_mul", num_threads);
}

// The decode step's packed skinny products (flashreinforce/skinny_gemm.h), for
// flashreinforce/engines/hf/packed_linear.py, which passes checked tensors: pointers as integers,
// element strides. The core's check is raised as ValueError; the work runs without the GIL.
void skinny_pack(const std::string& dtype, int64_t out_features, int64_t in_features, uintptr_t weight,
                 int64_t weight_stride, uintptr_t packed, int num_threads) {
  SkinnyPackParams p;
  p.dtype = step_dtype(dtype, "skinny_pack");
  p.out_features = out_features, p.in_features = in_features;
  p.weight = as_ptr(weight), p.weight_stride = weight_stride, p.packed = const_cast<void*>(as_ptr(packed));
  run_checked(p, &skinny_pack_check, &skinny_pack_cpu, "skinny_pack", num_threads);
}

void skinny_gemm(const std::string& dtype, int64_t rows, int64_t in_features, int64_t out_features, uintptr_t x,
                 int64_t x_stride, uintptr_t packed, uintptr_t bias, uintptr_t y, int64_t y_stride, int num_threads) {
  SkinnyGemmParams p;
  p.dtype = step_dtype(dtype, "skinny_gemm");
  p.rows = rows, p.in_features = in_features, p.out_features = out_features;
  p.x = as_ptr(x), p.x_stride = x_stride, p.packed = as_ptr(packed), p.bias = bias ? as_ptr(bias) : nullptr;
  p.y = const_cast<void*>(as_ptr(y)), p.y_stride = y_stride;
  run_checked(p, &skinny_gemm_check, &skinny_gemm_cpu, "skinny_gemm", num_threads);
}

// The learner's layer glue (flashreinforce/layer_glue.h): float32, contiguous; a pointer of 0 for an
// optional output means "not wanted".
float* as_out(uintptr_t value) { return reinterpret_cast<float*>(value); }
const float* as_in(uintptr_t value) { return reinterpret_cast<const float*>(value); }

void norm_forward(int64_t rows, int64_t hidden, uintptr_t x, uintptr_t weight, uintptr_t out, uintptr_t inv,
                  float eps, int num_threads, const std::string& out_dtype) {
  NormForwardParams p;
  p.rows = rows, p.hidden = hidden, p.x = as_in(x), p.weight = as_in(weight), p.out = as_out(out);
  p.out_dtype = step_dtype(out_dtype, "norm_forward");
  p.inv = as_out(inv), p.eps = eps;
  run_checked(p, &norm_forward_check, &norm_forward_cpu, "norm_forward", num_threads);
}

void norm_backward(int64_t rows, int64_t hidden, uintptr_t x, uintptr_t weight, uintptr_t inv, uintptr_t grad_out,
                   uintptr_t grad_x, uintptr_t grad_weight, int num_threads) {
  NormBackwardParams p;
  p.rows = rows, p.hidden = hidden, p.x = as_in(x), p.weight = as_in(weight), p.inv = as_in(inv);
  p.grad_out = as_in(grad_out), p.grad_x = as_out(grad_x), p.grad_weight = as_out(grad_weight);
  run_checked(p, &norm_backward_check, &norm_backward_cpu, "norm_backward", num_threads);
}

void silu_mul_forward(int64_t size, uintptr_t gate, uintptr_t up, uintptr_t out, int num_threads,
                      const std::string& dtype) {
  SiluMulForwardParams p;
  p.dtype = step_dtype(dtype, "silu_mul_forward");
  p.size = size, p.gate = as_in(gate), p.up = as_in(up), p.out = as_out(out);
  run_checked(p, &silu_mul_forward_check, &silu_mul_forward_cpu, "silu_mul_forward", num_threads);
}

void silu_mul_backward(int64_t size, uintptr_t gate, uintptr_t up, uintptr_t grad_out, uintptr_t grad_gate,
                       uintptr_t grad_up, int num_threads, const std::string& dtype) {
  SiluMulBackwardParams p;
  p.dtype = step_dtype(dtype, "silu_mul_backward");
  p.size = size, p.gate = as_in(gate), p.up = as_in(up), p.grad_out = as_in(grad_out);
  p.grad_gate = as_out(grad_gate), p.grad_up = as_out(grad_up);
  run_checked(p, &silu_mul_backward_check, &silu_mul_backward_cpu, "silu_mul_backward", num_threads);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Compiled core of FlashREINFORCE: the fused loss (CPU path, and CUDA when built with it) and the CPU "
            "decode-step attention of the hf engine, and the learner's RMS norm and SwiGLU with their gradients.";

  m.def("has_cuda", &has_cuda, "Whether the CUDA path was compiled into this module.");
  m.def("cpu_isa", []() { return std::string(cpu::cpu_isa_name()); },
        "Instruction set the CPU path uses on this machine for float32 inputs.");
  m.def("cpu_avx512_bf16", &cpu::cpu_uses_avx512_bf16,
        "Whether the CPU path also uses AVX-512 BF16 (the bfloat16 decode attention's scores, the bfloat16 "
        "skinny products): 'avx512' with the CPU's extension, unless FLASHREINFORCE_CPU_ISA names avx512.");
  m.def(
      "view_names",
      []() {
        py::list names;
        for (const ViewField& f : kViewFields) names.append(f.name);
        return py::tuple(names);
      },
      "Names of the LossParams views, inputs then outputs, in the struct's order.");
  m.def(
      "loss_option_fields",
      []() {
        py::list rows;
        for (const OptionField& f : kLossOptionFields) {
          py::list choices;
          for (int k = 0; k < f.num_choices; ++k) choices.append(f.choices[k]);
          rows.append(py::make_tuple(f.name, option_kind_name(f.kind), py::tuple(choices)));
        }
        return py::tuple(rows);
      },
      "The core's LossOptions fields in its table's order: (name, kind, choices) each.");
  m.def(
      "error_code_names",
      []() {
        py::list names;
        for (int c = 0; c < kNumErrorCodes; ++c) names.append(error_code_name(static_cast<ErrorCode>(c)));
        return py::tuple(names);
      },
      "Names of the core's error codes, by code (0 = ok); the order is the reporting priority.");
  m.def(
      "cuda_workspace_bytes",
      [](int64_t num_tokens, int64_t batch, bool filter) -> int64_t {
        return has_cuda() ? static_cast<int64_t>(cuda_workspace_bytes(num_tokens, batch, filter)) : 0;
      },
      py::arg("num_tokens"), py::arg("batch"), py::arg("filter"),
      "Bytes of device workspace a CUDA launch needs (0 without the CUDA path).");
  m.def("loss_forward", &loss_forward, py::arg("views"), py::arg("options"), py::arg("launch"),
        "Runs the fused forward (loss, gradient and statistics) into the output views; returns the error "
        "record (code, index), code 0 when the inputs were valid.");
  m.def("decode_attention", &decode_attention, py::arg("args"),
        "Decode-step attention of grouped query heads against a key/value cache on the CPU, written into "
        "args['out'] (flashreinforce/decode_attention.h; called by flashreinforce.engines.hf.decode_attention).");
  m.def("norm_forward", &norm_forward,
        "The learner's RMS norm over contiguous float32 rows, out in float32 or bfloat16, keeping 1 / RMS per row "
        "unless inv is 0 (flashreinforce/layer_glue.h).");
  m.def("norm_backward", &norm_backward, "The RMS norm's gradients of x and weight (flashreinforce/layer_glue.h).");
  m.def("silu_mul_forward", &silu_mul_forward, "silu(gate) * up over contiguous float32 or bfloat16 (flashreinforce/layer_glue.h).");
  m.def("silu_mul_backward", &silu_mul_backward,
        "The gradients of silu(gate) * up (flashreinforce/layer_glue.h).");
  m.def("decode_norm", &decode_norm, "A decode step's residual update and RMS norm (flashreinforce/decode_step.h).");
  m.def("decode_rotary", &decode_rotary,
        "A decode step's rotary embedding of queries and keys, the keys and values written to the cache slots "
        "(flashreinforce/decode_step.h).");
  m.def("decode_silu_mul", &decode_silu_mul, "A decode step's SwiGLU activation (flashreinforce/decode_step.h).");
  m.def("skinny_gemm_supported",
        [](const std::string& dtype) { return skinny_gemm_supported(step_dtype(dtype, "skinny_gemm_supported")); },
        "Whether this build and CPU run the packed skinny products for dtype (flashreinforce/skinny_gemm.h).");
  m.def("skinny_gemm_packed_elements",
        [](const std::string& dtype, int64_t out_features, int64_t in_features) {
          const DType dt = step_dtype(dtype, "skinny_gemm_packed_elements");
          return skinny_gemm_packed_elements(dt, out_features, in_features);
        },
        "Elements of a packed copy of an [out_features, in_features] weight (flashreinforce/skinny_gemm.h).");
  m.def("skinny_pack", &skinny_pack,
        "A weight copied into the skinny product's panels (flashreinforce/skinny_gemm.h).");
  m.def("skinny_gemm", &skinny_gemm, "x [rows, in] times a packed weight, plus bias (flashreinforce/skinny_gemm.h).");
}
