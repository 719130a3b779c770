// The tensor-core path of vllm#53060's TurboQuant decode with a split count
// chosen by the caller (its own dispatch, run_with_workspace, takes that
// path only when B x Hk >= the SM count). Compiled by ci/gpu/tqpeer.py
// beside the peer's sources staged in .peer/ (ci/gpu/peer_stage.sh); it
// only declares and calls the launcher the peer's mma_kernel.cu exports.
// Registered as torch.ops.tqpeer.mma_decode (the peer's own module
// defines the Python module of the extension).
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

extern "C" void turboquant_mma_decode_launch(
    const void* q, const void* kv_cache, const int* pt, const int* sl,
    const float* rot, const float* cen, void* out, void* part_o, void* part_ml,
    int B, int HQ, int HKV, int page_table_stride, int page_size, int head_dim,
    int splits, cudaStream_t stream);

// q (B, Hq, D) bf16; kv (blocks, Hk, 1, page * (D + 6)) uint8; table (B, n)
// int32 row-major; seq_lens (B,) int32; centroids (16,) fp32; part_o
// (splits * B * Hq * D) fp32 and part_ml (splits * B * Hq * 2) fp32 when
// splits > 1; out like q.
static void mma_decode(torch::Tensor q, torch::Tensor kv, torch::Tensor table,
                       torch::Tensor seq_lens, torch::Tensor centroids,
                       torch::Tensor part_o, torch::Tensor part_ml,
                       torch::Tensor out, int64_t page_size, int64_t splits) {
  const int64_t B = q.size(0), HQ = q.size(1), D = q.size(2);
  TORCH_CHECK(q.is_contiguous() && q.scalar_type() == at::kBFloat16);
  TORCH_CHECK(kv.is_contiguous() && kv.dim() == 4 &&
              kv.size(3) == page_size * (D + 6));
  TORCH_CHECK(table.scalar_type() == at::kInt && table.stride(1) == 1);
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes());
  TORCH_CHECK(splits >= 1 && (splits == 1 ||
              (part_o.numel() >= splits * B * HQ * D &&
               part_ml.numel() >= splits * B * HQ * 2)));
  c10::cuda::CUDAGuard guard(q.device());
  turboquant_mma_decode_launch(
      q.data_ptr(), kv.data_ptr(), table.data_ptr<int>(),
      seq_lens.data_ptr<int>(), nullptr, centroids.data_ptr<float>(),
      out.data_ptr(), splits > 1 ? part_o.data_ptr() : nullptr,
      splits > 1 ? part_ml.data_ptr() : nullptr, B, HQ, kv.size(1),
      table.stride(0), page_size, D, splits,
      c10::cuda::getCurrentCUDAStream().stream());
}

TORCH_LIBRARY(tqpeer, m) { m.def("mma_decode", &mma_decode); }
