// pybind11 bindings of the fused loss: the only place where Python meets the core.
//
// Tensors cross as plain descriptors built by flashreinforce/ops.py from torch tensors:
//   (data_ptr: int, shape: tuple[int], strides: tuple[int], dtype: str, device_type: str,
//    device_index: int)
// so this module needs no PyTorch at build time. Every input is validated here (shape, dtype,
// device, contiguity, lengths, options) and every failure raises ValueError naming the argument;
// value errors found by the core during its pass come back as (code, index) and are raised here
// too (ValueError, or FloatingPointError for an overflowing importance ratio).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "flashreinforce/core.h"

namespace py = pybind11;
using namespace flashreinforce;

namespace flashreinforce {
namespace cpu {
const char* cpu_isa_name();
}
}  // namespace flashreinforce

namespace {

struct Desc {
  std::string name;
  uintptr_t ptr = 0;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  std::string dtype;
  std::string device_type;
  int64_t device_index = -1;
  bool present = false;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
  std::string device() const {
    return device_index >= 0 ? device_type + ":" + std::to_string(device_index) : device_type;
  }
  std::string shape_str() const {
    std::ostringstream os;
    os << "(";
    for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
    if (shape.size() == 1) os << ",";
    os << ")";
    return os.str();
  }
};

[[noreturn]] void value_error(const std::string& msg) { throw py::value_error(msg); }

Desc parse(const char* name, const py::object& obj) {
  Desc d;
  d.name = name;
  if (obj.is_none()) return d;
  py::tuple t = obj.cast<py::tuple>();
  if (t.size() != 6) throw py::type_error(std::string(name) + ": malformed tensor descriptor");
  d.ptr = t[0].cast<uintptr_t>();
  d.shape = t[1].cast<std::vector<int64_t>>();
  d.strides = t[2].cast<std::vector<int64_t>>();
  d.dtype = t[3].cast<std::string>();
  d.device_type = t[4].cast<std::string>();
  d.device_index = t[5].cast<int64_t>();
  d.present = true;
  return d;
}

std::optional<DType> dtype_of(const std::string& s) {
  if (s == "float16") return DType::kFloat16;
  if (s == "bfloat16") return DType::kBFloat16;
  if (s == "float32") return DType::kFloat32;
  if (s == "float64") return DType::kFloat64;
  if (s == "int32") return DType::kInt32;
  if (s == "int64") return DType::kInt64;
  if (s == "bool") return DType::kBool;
  if (s == "int8") return DType::kInt8;
  if (s == "uint8") return DType::kUInt8;
  if (s == "int16") return DType::kInt16;
  return std::nullopt;
}

bool floating(const Desc& d) {
  auto t = dtype_of(d.dtype);
  return t && is_floating(*t);
}

void require_float(const Desc& d) {
  if (d.present && !floating(d)) {
    value_error(d.name + " must be a floating-point tensor, got " + d.dtype);
  }
}

void require_bool(const Desc& d) {
  if (d.present && d.dtype != "bool") value_error(d.name + " must be a bool tensor, got " + d.dtype);
}

void require_contiguous(const Desc& d) {
  if (!d.present) return;
  int64_t expected = 1;
  for (int64_t k = static_cast<int64_t>(d.shape.size()) - 1; k >= 0; --k) {
    if (d.shape[k] != 1 && d.strides[k] != expected) {
      value_error(d.name + " must be contiguous (the ops layer passes contiguous tensors)");
    }
    expected *= d.shape[k];
  }
}

void require_shape(const Desc& d, const std::vector<int64_t>& shape, const std::string& like) {
  if (d.present && d.shape != shape) {
    Desc want;
    want.shape = shape;
    std::string w = want.shape_str();
    value_error(d.name + " must have shape " + w + like + ", got " + d.shape_str());
  }
}

struct Options {
  double delta;
  double q;
  std::optional<double> reward_baseline;
  std::optional<int64_t> num_trajectories;
  std::string loss_agg;
  std::optional<double> loss_scale_factor;
  std::optional<int64_t> num_policy_tokens;
  bool no_is;
};

LossAgg parse_options(const Options& o, bool have_entropies, bool have_failures) {
  if (std::isnan(o.delta) || o.delta < 0) {
    std::ostringstream os;
    os << "delta must be a non-negative number (inf disables the gate), got " << o.delta;
    value_error(os.str());
  }
  if (std::isnan(o.q) || o.q < 0.0 || o.q > 1.0) {
    std::ostringstream os;
    os << "negative_token_fraction must be in [0, 1], got " << o.q;
    value_error(os.str());
  }
  if (o.q < 1.0 && (!have_entropies || !have_failures)) {
    std::string missing = !have_entropies && !have_failures ? "entropies and failures"
                          : !have_entropies                ? "entropies"
                                                           : "failures";
    value_error("negative_token_fraction < 1 needs entropies and failures; missing " + missing);
  }
  LossAgg agg;
  if (o.loss_agg == "seq-mean-token-mean") {
    agg = LossAgg::kSeqMeanTokenMean;
  } else if (o.loss_agg == "token-mean") {
    agg = LossAgg::kTokenMean;
  } else if (o.loss_agg == "seq-mean-token-sum-norm") {
    agg = LossAgg::kSeqMeanTokenSumNorm;
  } else {
    value_error("loss_agg must be one of ('seq-mean-token-mean', 'token-mean', 'seq-mean-token-sum-norm'), got '" +
                o.loss_agg + "'");
  }
  if (agg == LossAgg::kSeqMeanTokenSumNorm) {
    if (!o.loss_scale_factor || !std::isfinite(*o.loss_scale_factor) || *o.loss_scale_factor <= 0) {
      std::ostringstream os;
      os << "loss_scale_factor must be a positive finite number for seq-mean-token-sum-norm, got ";
      if (o.loss_scale_factor) os << *o.loss_scale_factor; else os << "None";
      value_error(os.str());
    }
  } else if (o.loss_scale_factor) {
    value_error("loss_scale_factor is only used with loss_agg='seq-mean-token-sum-norm', not '" + o.loss_agg + "'");
  }
  if (o.num_trajectories && *o.num_trajectories <= 0) {
    value_error("num_trajectories must be a positive integer, got " + std::to_string(*o.num_trajectories));
  }
  if (o.num_policy_tokens && *o.num_policy_tokens <= 0) {
    value_error("num_policy_tokens must be a positive integer, got " + std::to_string(*o.num_policy_tokens));
  }
  if (o.reward_baseline && !std::isfinite(*o.reward_baseline)) {
    std::ostringstream os;
    os << "reward_baseline must be finite, got " << *o.reward_baseline;
    value_error(os.str());
  }
  return agg;
}

std::string format_double(double v) {
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}

std::string token_name(int64_t t, int64_t padded_width) {
  std::string s = std::to_string(t);
  if (padded_width > 0) {
    s += " (row " + std::to_string(t / padded_width) + ", column " + std::to_string(t % padded_width) + ")";
  }
  return s;
}

void raise_error(const Error& e, int64_t n, int64_t b, int64_t padded_width, bool have_value) {
  const std::string v = have_value ? format_double(e.value) : std::string("(value on device)");
  switch (e.code) {
    case ErrorCode::kOk: return;
    case ErrorCode::kBadCuSeqlens:
      if (e.index == 0) value_error("cu_seqlens must start at 0, got " + v);
      if (e.index == b) {
        value_error("cu_seqlens must end at N = " + std::to_string(n) + " (the length of log_probs), got " + v);
      }
      value_error("cu_seqlens must be non-decreasing (cu_seqlens[" + std::to_string(e.index) +
                  "] is smaller than the offset before it)");
    case ErrorCode::kNoPolicyTokens:
      value_error("action_mask: trajectory " + std::to_string(e.index) + " has no policy token");
    case ErrorCode::kNonFiniteReward:
      value_error("rewards must be finite (rewards[" + std::to_string(e.index) + "] = " + v + ")");
    case ErrorCode::kBadLogProb:
      value_error("log_probs: policy token " + token_name(e.index, padded_width) + " has log probability " + v +
                  "; policy-token log probabilities must be finite and <= 0");
    case ErrorCode::kBadBehaviorLogProb:
      value_error("behavior_log_probs: policy token " + token_name(e.index, padded_width) +
                  " has log probability " + v + "; policy-token log probabilities must be finite and <= 0");
    case ErrorCode::kBadEntropy:
      value_error("entropies: policy token " + token_name(e.index, padded_width) + " has non-finite entropy " + v);
    case ErrorCode::kRatioOverflow: {
      std::string msg = "importance ratio overflows on active token " + token_name(e.index, padded_width) +
                        " (log_probs - behavior_log_probs = " + v + " is too large)";
      PyErr_SetString(PyExc_FloatingPointError, msg.c_str());
      throw py::error_already_set();
    }
  }
  throw std::runtime_error("flashreinforce: unknown error code " + std::to_string(static_cast<int>(e.code)));
}

// Validates everything and fills the core's structs. `padded`: log_probs is [B, T] and
// cu_seqlens is absent.
struct Prepared {
  LossInputs in;
  LossOutputs out;
  bool cuda = false;
  int64_t padded_width = 0;
  int device_index = -1;
};

Prepared prepare(bool padded, const Desc& lp, const Desc& blp, const Desc& rewards, const Desc& cu,
                 const Desc& mask, const Desc& ent, const Desc& fail, const Options& opt,
                 const std::vector<Desc>& outs) {
  // Dtypes first (as the reference does), then devices, then shapes.
  require_float(lp);
  require_float(blp);
  require_float(ent);
  require_bool(mask);
  require_bool(fail);
  auto rdt = dtype_of(rewards.dtype);
  if (!rdt || *rdt == DType::kBool) value_error("rewards must be a real-valued tensor, got " + rewards.dtype);
  if (!padded && cu.present && cu.dtype != "int32" && cu.dtype != "int64") {
    value_error("cu_seqlens must be int32 or int64, got " + cu.dtype);
  }
  for (const Desc* d : {&blp, &rewards, &cu, &mask, &ent, &fail}) {
    if (d->present && (d->device_type != lp.device_type || d->device_index != lp.device_index)) {
      value_error(d->name + " is on " + d->device() + " but log_probs is on " + lp.device());
    }
  }
  if (lp.device_type != "cpu" && lp.device_type != "cuda") {
    value_error("log_probs is on " + lp.device() + "; the fused loss runs on cpu and cuda tensors");
  }

  Prepared p;
  int64_t n, b;
  if (padded) {
    if (lp.shape.size() != 2 || lp.numel() == 0) {
      value_error("log_probs must be a non-empty [B, T] tensor, got shape " + lp.shape_str());
    }
    if (!mask.present) value_error("action_mask must be a torch.Tensor, got NoneType");
    require_shape(blp, lp.shape, " like log_probs");
    require_shape(mask, lp.shape, " like log_probs");
    require_shape(ent, lp.shape, " like log_probs");
    b = lp.shape[0];
    n = lp.numel();
    if (rewards.shape != std::vector<int64_t>{b}) {
      value_error("rewards must have shape [" + std::to_string(b) + "], got " + rewards.shape_str());
    }
    p.padded_width = lp.shape[1];
  } else {
    if (lp.shape.size() != 1 || lp.numel() == 0) {
      value_error("log_probs must be a non-empty 1-D [N] tensor, got shape " + lp.shape_str());
    }
    if (rewards.shape.size() != 1 || rewards.numel() == 0) {
      value_error("rewards must be a non-empty 1-D [B] tensor, got shape " + rewards.shape_str());
    }
    n = lp.shape[0];
    b = rewards.shape[0];
    for (const Desc* d : {&blp, &mask, &ent}) {
      if (d->present && d->shape != std::vector<int64_t>{n}) {
        value_error(d->name + " must have shape [" + std::to_string(n) + "] like log_probs, got " + d->shape_str());
      }
    }
    if (!cu.present) value_error("cu_seqlens must be a torch.Tensor, got NoneType");
    if (cu.shape != std::vector<int64_t>{b + 1}) {
      value_error("cu_seqlens must have shape [B+1] = [" + std::to_string(b + 1) + "], got " + cu.shape_str());
    }
  }
  if (fail.present && fail.shape != std::vector<int64_t>{b}) {
    value_error("failures must have shape [" + std::to_string(b) + "] like rewards, got " + fail.shape_str());
  }
  for (const Desc* d : {&lp, &blp, &rewards, &cu, &mask, &ent, &fail}) require_contiguous(*d);

  const LossAgg agg = parse_options(opt, ent.present, fail.present);

  LossInputs& in = p.in;
  in.num_tokens = n;
  in.batch = b;
  in.log_probs = reinterpret_cast<const void*>(lp.ptr);
  in.log_probs_dtype = *dtype_of(lp.dtype);
  in.behavior_log_probs = reinterpret_cast<const void*>(blp.ptr);
  in.behavior_dtype = *dtype_of(blp.dtype);
  in.rewards = reinterpret_cast<const void*>(rewards.ptr);
  in.rewards_dtype = *rdt;
  if (padded) {
    in.cu_seqlens = nullptr;
    in.padded_row_length = p.padded_width;
  } else {
    in.cu_seqlens = reinterpret_cast<const void*>(cu.ptr);
    in.cu_dtype = *dtype_of(cu.dtype);
  }
  in.action_mask = mask.present ? reinterpret_cast<const uint8_t*>(mask.ptr) : nullptr;
  const bool filter = opt.q < 1.0;
  in.entropies = filter ? reinterpret_cast<const void*>(ent.ptr) : nullptr;
  in.entropies_dtype = ent.present ? *dtype_of(ent.dtype) : DType::kFloat32;
  in.failures = filter ? reinterpret_cast<const uint8_t*>(fail.ptr) : nullptr;
  in.delta = opt.delta;
  in.negative_token_fraction = opt.q;
  in.has_reward_baseline = opt.reward_baseline.has_value();
  in.reward_baseline = opt.reward_baseline.value_or(0.0);
  in.num_trajectories = opt.num_trajectories.value_or(0);
  in.loss_agg = agg;
  in.loss_scale_factor = opt.loss_scale_factor.value_or(0.0);
  in.num_policy_tokens = opt.num_policy_tokens.value_or(0);
  in.no_is = opt.no_is;
  if (const char* msg = check_options(in)) value_error(msg);

  // Outputs (allocated by ops.py; checked defensively: a mismatch is a bug, not a user error).
  const std::string cdt = compute_dtype(in.log_probs_dtype) == DType::kFloat64 ? "float64" : "float32";
  const std::vector<std::pair<std::string, std::vector<int64_t>>> want = {
      {cdt, {}}, {lp.dtype, lp.shape}, {cdt, {b}}, {cdt, {b}}, {"bool", {b}}, {cdt, {}}, {"int64", {b}}, {"int64", {b}}};
  if (outs.size() != want.size()) throw std::runtime_error("flashreinforce: wrong number of outputs");
  for (size_t k = 0; k < want.size(); ++k) {
    const Desc& o = outs[k];
    if (!o.present || o.dtype != want[k].first || o.shape != want[k].second || o.device_type != lp.device_type ||
        o.device_index != lp.device_index) {
      throw std::runtime_error("flashreinforce: output " + o.name + " has the wrong dtype, shape or device");
    }
    require_contiguous(o);
  }
  LossOutputs& out = p.out;
  out.loss = reinterpret_cast<void*>(outs[0].ptr);
  out.grad = reinterpret_cast<void*>(outs[1].ptr);
  out.advantages = reinterpret_cast<void*>(outs[2].ptr);
  out.sequence_kl = reinterpret_cast<void*>(outs[3].ptr);
  out.admitted = reinterpret_cast<uint8_t*>(outs[4].ptr);
  out.acceptance_rate = reinterpret_cast<void*>(outs[5].ptr);
  out.policy_tokens = reinterpret_cast<int64_t*>(outs[6].ptr);
  out.retained_tokens = reinterpret_cast<int64_t*>(outs[7].ptr);
  p.cuda = lp.device_type == "cuda";
  p.device_index = static_cast<int>(lp.device_index);
  return p;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Compiled core of the fused FlashREINFORCE loss (CPU path, and CUDA when built with it).";

  m.def("has_cuda", &has_cuda, "Whether the CUDA path was compiled into this module.");
  m.def("cpu_isa", []() { return std::string(cpu::cpu_isa_name()); },
        "Instruction set the CPU path uses on this machine for float32 inputs.");

  m.def(
      "workspace_bytes",
      [](py::object lp, py::object rewards, bool padded, double q) -> int64_t {
        Desc l = parse("log_probs", lp), r = parse("rewards", rewards);
        if (l.device_type != "cuda") return 0;
        LossInputs in;
        in.num_tokens = l.numel();
        in.batch = padded ? (l.shape.empty() ? 0 : l.shape[0]) : (r.shape.empty() ? 0 : r.shape[0]);
        in.negative_token_fraction = q;
        if (in.num_tokens <= 0 || in.batch <= 0) return 0;
        return static_cast<int64_t>(cuda_workspace_bytes(in));
      },
      py::arg("log_probs"), py::arg("rewards"), py::arg("padded"), py::arg("negative_token_fraction"),
      "Bytes of device workspace a CUDA launch needs (0 on the CPU).");

  m.def(
      "loss_forward",
      [](bool padded, py::object log_probs, py::object behavior_log_probs, py::object rewards, py::object cu_seqlens,
         py::object action_mask, py::object entropies, py::object failures, double delta,
         double negative_token_fraction, std::optional<double> reward_baseline,
         std::optional<int64_t> num_trajectories, std::string loss_agg, std::optional<double> loss_scale_factor,
         std::optional<int64_t> num_policy_tokens, bool no_is, std::vector<py::object> outputs,
         py::object workspace, py::object error_record, int num_threads, uintptr_t stream,
         bool raise_errors) -> py::tuple {
        Desc lp = parse("log_probs", log_probs), blp = parse("behavior_log_probs", behavior_log_probs);
        Desc rw = parse("rewards", rewards), cu = parse("cu_seqlens", cu_seqlens);
        Desc mask = parse("action_mask", action_mask), ent = parse("entropies", entropies);
        Desc fail = parse("failures", failures);
        if (!lp.present) value_error("log_probs must be a torch.Tensor, got NoneType");
        if (!blp.present) value_error("behavior_log_probs must be a torch.Tensor, got NoneType");
        if (!rw.present) value_error("rewards must be a torch.Tensor, got NoneType");
        static const char* names[] = {"loss", "grad", "advantages", "sequence_kl", "admitted",
                                      "acceptance_rate", "policy_tokens", "retained_tokens"};
        std::vector<Desc> outs;
        for (size_t k = 0; k < outputs.size(); ++k) outs.push_back(parse(k < 8 ? names[k] : "output", outputs[k]));
        Options opt{delta, negative_token_fraction, reward_baseline, num_trajectories,
                    loss_agg, loss_scale_factor, num_policy_tokens, no_is};
        Prepared p = prepare(padded, lp, blp, rw, cu, mask, ent, fail, opt, outs);
        Desc err = parse("error_record", error_record);
        if (!err.present || err.dtype != "int64" || err.numel() != 2 || err.device_type != lp.device_type) {
          throw std::runtime_error("flashreinforce: error_record must be an int64 tensor of 2 elements on the inputs' device");
        }
        Error e;
        if (p.cuda) {
          if (!has_cuda()) {
            throw std::runtime_error(
                "flashreinforce._C was built without CUDA, but the inputs are CUDA tensors; reinstall with a CUDA "
                "compiler available (FLASHREINFORCE_CUDA=ON) or move the inputs to the CPU");
          }
          Desc ws = parse("workspace", workspace);
          const size_t need = cuda_workspace_bytes(p.in);
          if (!ws.present || static_cast<size_t>(ws.numel()) < need || ws.device_type != "cuda") {
            throw std::runtime_error("flashreinforce: CUDA workspace missing or too small");
          }
          {
            py::gil_scoped_release release;
            e = loss_forward_cuda(p.in, p.out, reinterpret_cast<void*>(ws.ptr), reinterpret_cast<int64_t*>(err.ptr),
                                  reinterpret_cast<void*>(stream), raise_errors);
          }
          if (raise_errors) raise_error(e, p.in.num_tokens, p.in.batch, p.padded_width, false);
        } else {
          {
            py::gil_scoped_release release;
            e = loss_forward_cpu(p.in, p.out, num_threads);
          }
          int64_t* rec = reinterpret_cast<int64_t*>(err.ptr);
          rec[0] = static_cast<int64_t>(e.code);
          rec[1] = e.index;
          if (raise_errors) raise_error(e, p.in.num_tokens, p.in.batch, p.padded_width, true);
        }
        return py::make_tuple(static_cast<int>(e.code), e.index);
      },
      py::arg("padded"), py::arg("log_probs"), py::arg("behavior_log_probs"), py::arg("rewards"),
      py::arg("cu_seqlens"), py::arg("action_mask"), py::arg("entropies"), py::arg("failures"), py::arg("delta"),
      py::arg("negative_token_fraction"), py::arg("reward_baseline"), py::arg("num_trajectories"),
      py::arg("loss_agg"), py::arg("loss_scale_factor"), py::arg("num_policy_tokens"), py::arg("no_is"),
      py::arg("outputs"), py::arg("workspace"), py::arg("error_record"), py::arg("num_threads"),
      py::arg("stream"), py::arg("raise_errors"),
      "Validates the inputs and runs the fused forward (loss, gradient and statistics) into the outputs.");

  m.def(
      "raise_for_error",
      [](int code, int64_t index, int64_t num_tokens, int64_t batch, int64_t padded_width) {
        Error e;
        e.code = static_cast<ErrorCode>(code);
        e.index = index;
        raise_error(e, num_tokens, batch, padded_width, false);
      },
      py::arg("code"), py::arg("index"), py::arg("num_tokens"), py::arg("batch"), py::arg("padded_width"),
      "Raises the exception of an error record read back from a capturable launch.");
}
