"""Calls every public function of a ``flashreinforce._C`` module file, without PyTorch or NumPy.

Run as a script by ``test_cpu_isa.py`` in subprocesses (also under an emulated CPU):

    python cpu_entry_points.py PATH/TO/_C.so

It loads the module from its file (not through the ``flashreinforce`` package, which imports
PyTorch), calls ``has_cuda``, ``cpu_isa``, ``cpu_avx512_bf16``, ``view_names``, ``error_code_names`` and
``cuda_workspace_bytes``, then ``loss_forward`` on small packed batches covering every pair of
log-prob dtypes, with and without a mask, ``no_is``, every gate metric with truncated ratios, the
entropy filter (every entropy dtype), the padded form, several chunks on two threads, and the error paths (an invalid log-prob, an
overflowing ratio); then ``decode_attention`` in float32 and bfloat16 (head sizes on and off the
vector width, groups of one to seven queries, masked positions, a request with none attended, strided
queries, one and two threads) and its argument check; then the skinny products' packing (every CPU)
and product (where ``skinny_gemm_supported``; elsewhere it must refuse) in float32 and bfloat16. It
prints one JSON line: the instruction set in use, the number of calls and
SHA-256 digests of every output byte and error record, one for the float32-compute calls and one for
the float64 ones, so that two runs of the same instruction set can be compared bit for bit. (The
float64 path calls the C library's exp / log, whose glibc variant depends on the CPU model.)
"""

from __future__ import annotations

import array
import hashlib
import importlib.util
import json
import math
import struct
import sys

FLOATS = ("float16", "bfloat16", "float32", "float64")


class Lcg:
    """A small deterministic generator (the same numbers on every machine and interpreter)."""

    def __init__(self, seed: int):
        self.state = seed

    def uniform(self) -> float:
        self.state = (self.state * 6364136223846793005 + 1442695040888963407) % 2**64
        return (self.state >> 11) / 2.0**53


def buffer(values, dtype: str) -> array.array:
    """An array.array holding ``values`` in the storage format of ``dtype``."""
    if dtype == "float32":
        return array.array("f", values)
    if dtype == "float64":
        return array.array("d", values)
    if dtype == "float16":
        return array.array("H", [struct.unpack("<H", struct.pack("<e", v))[0] for v in values])
    if dtype == "bfloat16":  # round to nearest even from float32
        out = array.array("H")
        for v in values:
            u = struct.unpack("<I", struct.pack("<f", v))[0]
            out.append(((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF)
        return out
    if dtype == "int64":
        return array.array("q", values)
    if dtype in ("bool", "uint8"):
        return array.array("B", values)
    raise ValueError(dtype)


def view(buf: array.array, dtype: str):
    return (buf.buffer_info()[0], len(buf), dtype)


def batch(gen: Lcg, lengths, spread: float):
    """Log-probs of a packed batch (behavior close to current), a mask, entropies and rewards."""
    n = sum(lengths)
    current = [-4.0 * gen.uniform() * gen.uniform() for _ in range(n)]
    behavior = [min(0.0, x + spread * (gen.uniform() - 0.5)) for x in current]
    mask = [1 if gen.uniform() < 0.85 else 0 for _ in range(n)]
    cu, start = [0], 0
    for length in lengths:
        mask[start + length - 1] = 1  # every trajectory has a policy token
        start += length
        cu.append(start)
    entropies = [5.0 * gen.uniform() for _ in range(n)]
    rewards = [float(gen.uniform() < 0.5) for _ in lengths]
    failures = [1 if gen.uniform() < 0.5 else 0 for _ in lengths]
    return dict(current=current, behavior=behavior, mask=mask, cu=cu, entropies=entropies, rewards=rewards,
                failures=failures)


def run(C, data, digests, *, lp="float32", blp="float32", ent="float32", masked=True, no_is=False, q=1.0,
        padded_row_length=0, threads=1, poison=None, gate_metric="binary_kl", is_truncation=math.inf):
    """One loss_forward call; feeds every output byte and the error record into the digest of its
    compute dtype."""
    n, b = len(data["current"]), len(data["rewards"])
    current = list(data["current"])
    behavior = list(data["behavior"])
    if poison == "log_prob":
        current[n // 2] = math.nan
        data_mask = list(data["mask"])
        data_mask[n // 2] = 1
    else:
        data_mask = data["mask"]
    if poison == "ratio":
        current[n - 1], behavior[n - 1] = -0.1, -800.0
    compute = "float64" if lp == "float64" else "float32"
    keep = []  # every buffer stays alive until the call returns

    def make(values, dtype):
        buf = buffer(values, dtype)
        keep.append(buf)
        return buf

    outputs = dict(loss=make([0.0], compute), grad=make([0.0] * n, lp), advantages=make([0.0] * b, compute),
                   sequence_kl=make([0.0] * b, compute), admitted=make([0] * b, "bool"),
                   acceptance_rate=make([0.0], compute), policy_tokens=make([0] * b, "int64"),
                   retained_tokens=make([0] * b, "int64"))
    record = make([0, 0], "int64")
    views = dict(log_probs=view(make(current, lp), lp), behavior_log_probs=view(make(behavior, blp), blp),
                 rewards=view(make(data["rewards"], "float64"), "float64"),
                 cu_seqlens=None if padded_row_length else view(make(data["cu"], "int64"), "int64"),
                 action_mask=view(make(data_mask, "bool"), "bool") if masked else None,
                 entropies=view(make(data["entropies"], ent), ent) if q < 1.0 else None,
                 failures=view(make(data["failures"], "bool"), "bool") if q < 1.0 else None,
                 error_record=view(record, "int64"), workspace=None)
    views.update({name: view(buf, ("bool" if name == "admitted" else "int64" if name.endswith("tokens") else
                                   lp if name == "grad" else compute)) for name, buf in outputs.items()})
    options = dict(delta=math.inf if poison else 3e-3, negative_token_fraction=q, reward_baseline=None, num_trajectories=None,
                   loss_agg="seq-mean-token-mean", loss_scale_factor=None, num_policy_tokens=None, no_is=no_is,
                   gate_metric=gate_metric, is_truncation=is_truncation)
    launch = dict(device="cpu", padded_row_length=padded_row_length, num_threads=threads, stream=0,
                  synchronize=True)
    code, index = C.loss_forward(views, options, launch)
    digest = digests[compute]
    digest.update(struct.pack("<qq", code, index))
    digest.update(record.tobytes())
    for buf in outputs.values():
        digest.update(buf.tobytes())
    return code


def attention(C, gen: Lcg, digest, dtype: str, batch: int, kv_heads: int, groups: int, head_dim: int,
              length: int, threads: int, empty_request: bool = False) -> None:
    """One decode_attention call on random data (queries with padded rows, a cache longer than
    ``length``); feeds the output bytes into ``digest``."""
    q_group, cap = head_dim + 3, length + 2
    q_batch, kv_batch, mask_batch = kv_heads * groups * q_group, kv_heads * cap * head_dim, length + 1
    q = buffer([gen.uniform() * 2 - 1 for _ in range(batch * q_batch)], dtype)
    k = buffer([gen.uniform() * 2 - 1 for _ in range(batch * kv_batch)], dtype)
    v = buffer([gen.uniform() * 2 - 1 for _ in range(batch * kv_batch)], dtype)
    mask = [1 if gen.uniform() < 0.8 else 0 for _ in range(batch * mask_batch)]
    for b in range(batch):
        mask[b * mask_batch + length - 1] = 1  # this step's own token
    if empty_request:
        mask[:length] = [0] * length
    mask = buffer(mask, "uint8")
    out = buffer([0.0] * (batch * kv_heads * groups * head_dim), dtype)
    C.decode_attention({
        "dtype": dtype, "batch": batch, "kv_heads": kv_heads, "groups": groups, "head_dim": head_dim,
        "length": length, "scale": head_dim ** -0.5, "num_threads": threads,
        "q": q.buffer_info()[0], "q_strides": (q_batch, groups * q_group, q_group),
        "k": k.buffer_info()[0], "k_strides": (kv_batch, cap * head_dim, head_dim),
        "v": v.buffer_info()[0], "v_strides": (kv_batch, cap * head_dim, head_dim),
        "mask": mask.buffer_info()[0], "mask_stride_batch": mask_batch, "out": out.buffer_info()[0]})
    digest.update(out.tobytes())


def skinny(C, gen: Lcg, digest, dtype: str, rows: int, n_in: int, n_out: int, threads: int) -> None:
    """One skinny_pack (and, where the CPU runs it, one skinny_gemm with a bias) on random data; feeds
    the packed and output bytes into ``digest``; a CPU without the kernels must refuse the product."""
    w = buffer([gen.uniform() * 2 - 1 for _ in range(n_out * n_in)], dtype)
    x = buffer([gen.uniform() * 2 - 1 for _ in range(rows * n_in)], dtype)
    bias = buffer([gen.uniform() * 2 - 1 for _ in range(n_out)], dtype)
    packed = buffer([0.0] * C.skinny_gemm_packed_elements(dtype, n_out, n_in), dtype)
    C.skinny_pack(dtype, n_out, n_in, w.buffer_info()[0], n_in, packed.buffer_info()[0], threads)
    digest.update(packed.tobytes())
    y = buffer([0.0] * (rows * n_out), dtype)
    args = (dtype, rows, n_in, n_out, x.buffer_info()[0], n_in, packed.buffer_info()[0], bias.buffer_info()[0],
            y.buffer_info()[0], n_out, threads)
    if C.skinny_gemm_supported(dtype):
        C.skinny_gemm(*args)
        digest.update(y.tobytes())
        return
    try:
        C.skinny_gemm(*args)
    except ValueError as err:
        assert "AVX-512" in str(err), err
    else:
        raise AssertionError(f"skinny_gemm ran {dtype} where skinny_gemm_supported says it cannot")


def main(path: str) -> None:
    spec = importlib.util.spec_from_file_location("_C", path)
    C = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(C)
    digest = {"float32": hashlib.sha256(), "float64": hashlib.sha256()}
    workspace = C.cuda_workspace_bytes(1000, 10, True)
    assert workspace > 0 if C.has_cuda() else workspace == 0, workspace
    digest["float32"].update(repr((C.has_cuda(), C.view_names(), C.error_code_names(), workspace)).encode())
    gen = Lcg(20261202)
    small = batch(gen, [1, 2, 3, 17, 40, 300, 700, 5, 1200], spread=0.05)
    calls = 0
    for lp in FLOATS:
        for blp in FLOATS:
            for masked in (True, False):
                run(C, small, digest, lp=lp, blp=blp, masked=masked)
                calls += 1
        run(C, small, digest, lp=lp, masked=True, no_is=True)
        for ent in FLOATS:
            run(C, small, digest, lp=lp, ent=ent, q=0.5)
        for poison in ("log_prob", "ratio"):
            code = run(C, small, digest, lp=lp, poison=poison)
            assert code != 0, (lp, poison)
        for metric in ("kpop", "k3", "log_ratio"):
            run(C, small, digest, lp=lp, gate_metric=metric, is_truncation=1.5)
        assert run(C, small, digest, lp=lp, poison="ratio", is_truncation=2.0) == 0  # clipped, not an overflow
        calls += 11
    padded = batch(gen, [64] * 12, spread=0.05)
    run(C, padded, digest, padded_row_length=64)
    large = batch(gen, [9000, 30, 25000, 3, 6000], spread=0.02)  # several 16,384-token chunks
    for lp in ("float32", "bfloat16"):
        run(C, large, digest, lp=lp, threads=2)
        run(C, large, digest, lp=lp, threads=2, q=0.3)
    calls += 5
    for dtype in ("float32", "bfloat16"):
        for shape in ((3, 2, 3, 64, 37), (2, 1, 1, 16, 1), (4, 3, 5, 128, 70), (2, 2, 7, 40, 19)):
            for threads in (1, 2):
                attention(C, gen, digest["float32"], dtype, *shape, threads=threads)
                calls += 1
        attention(C, gen, digest["float32"], dtype, 3, 2, 2, 32, 9, threads=2, empty_request=True)
        calls += 1
    try:
        attention(C, gen, digest["float32"], "float64", 1, 1, 1, 16, 4, threads=1)
    except ValueError as err:
        assert "dtype" in str(err), err
        calls += 1
    else:
        raise AssertionError("decode_attention took float64")
    for dtype in ("float32", "bfloat16"):
        for rows, n_in, n_out, threads in ((1, 5, 7, 1), (9, 64, 100, 2), (17, 33, 48, 2)):
            skinny(C, gen, digest["float32"], dtype, rows, n_in, n_out, threads)
            calls += 1
    print(json.dumps({"isa": C.cpu_isa(), "avx512_bf16": C.cpu_avx512_bf16(), "calls": calls, "float32": digest["float32"].hexdigest(),
                      "float64": digest["float64"].hexdigest()}))


if __name__ == "__main__":
    main(sys.argv[1])
