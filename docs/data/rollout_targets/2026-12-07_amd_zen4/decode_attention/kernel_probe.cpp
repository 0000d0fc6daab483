// The C++ probe behind kernel_probe_side_by_side.txt: the compiled core's decode_attention_cpu at the
// engine's shape, linked against libfr_core.a of one build (this commit's, or 2b415e5's built from a git
// worktree with cmake --target fr_core):  g++ -O2 -std=c++17 -Icsrc probe.cpp libfr_core.a -lpthread -ldl
// args: bf16|fp32 batch threads layers reps length capacity. No OpenMP runtime: the core's own pool.
#include <chrono>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cstdint>
#include "flashreinforce/decode_attention.h"
using namespace flashreinforce;
int main(int argc, char** argv) {
  const bool bf = argc > 1 && std::strcmp(argv[1], "bf16") == 0;
  const int64_t B = argc > 2 ? atoi(argv[2]) : 4, K = 3, G = 3, D = 64, L = argc > 6 ? atoi(argv[6]) : 128; const int64_t cap = argc > 7 ? atoi(argv[7]) : L;
  const int threads = argc > 3 ? atoi(argv[3]) : 1;
  const int layers = argc > 4 ? atoi(argv[4]) : 1;
  const long reps = argc > 5 ? atol(argv[5]) : 20000;
  const size_t es = bf ? 2 : 4;
  std::vector<std::vector<char>> kv(2 * layers, std::vector<char>(B * K * cap * D * es));
  for (auto& x : kv) for (size_t i = 0; i < x.size(); i += 2) { x[i] = rand() & 0x7f; x[i+1] = bf ? 0x3f : rand(); }
  std::vector<char> q(B * K * G * D * es), out(B * K * G * D * es);
  for (size_t i = 0; i < q.size(); i += 2) { q[i] = rand(); q[i+1] = 0x3e; }
  std::vector<uint8_t> mask(B * L, 1);
  DecodeAttentionParams p;
  p.dtype = bf ? DType::kBFloat16 : DType::kFloat32;
  p.batch = B; p.kv_heads = K; p.groups = G; p.head_dim = D; p.length = L; p.scale = 0.125f;
  p.q = q.data(); p.q_stride_batch = K * G * D; p.q_stride_head = G * D; p.q_stride_group = D;
  p.k_stride_batch = K * cap * D; p.k_stride_head = cap * D; p.k_stride_pos = D;
  p.v_stride_batch = K * cap * D; p.v_stride_head = cap * D; p.v_stride_pos = D;
  p.mask = mask.data(); p.mask_stride_batch = L; p.out = out.data();
  p.k = kv[0].data(); p.v = kv[0].data();
  if (const char* e = decode_attention_check(p); e[0]) { printf("%s\n", e); return 1; }
  double s = 1e30;
  for (int t = 0; t < 7; ++t) {
  auto t0 = std::chrono::steady_clock::now();
  for (long r = 0; r < reps / 7; ++r) for (int l = 0; l < layers; ++l) {
    p.k = kv[2 * l].data(); p.v = kv[2 * l + 1].data();
    decode_attention_cpu(p, threads);
  }
  s = std::min(s, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 7);
  }
  printf("%s B=%ld threads=%d layers=%d: %.2f ns per row\n", bf ? "bf16" : "fp32", (long)B, threads, layers, s / reps / layers / (B * K * L) * 1e9);
}
