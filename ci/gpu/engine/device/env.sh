# Sourced on the device by call.sh (and by hand: `source ci/gpu/engine/device/env.sh`).
# PYTHONPATH is set per job by driver.py: the release tree first, then the deps.
export ENG_ROOT=${ENG_ROOT:-/root/eng}
export PYTHONUNBUFFERED=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_USE_FLASHINFER_SAMPLER=0          # flashinfer is not staged
export VLLM_ALLOW_INSECURE_SERIALIZATION=1    # collective_rpc(callable) probes with MP=1
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-INFO}
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1       # xgrammar's tvm-ffi must not JIT-build a torch addon
export TOKENIZERS_PARALLELISM=false
# caches shared by the jobs of the campaign (persist while the machine is held)
export VLLM_CACHE_ROOT=$ENG_ROOT/cache/vllm
export TRITON_CACHE_DIR=$ENG_ROOT/cache/triton
export TORCHINDUCTOR_CACHE_DIR=$ENG_ROOT/cache/inductor
export TORCHINDUCTOR_COMPILE_THREADS=4        # up to 6 engines compile at once on 16 cores
# the device library's rule: NVLink multicast stays off
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_DEEP_GEMM=0 VLLM_DEEP_GEMM_WARMUP=skip
