# Source on a GPU machine: multicast off, the repo and any carried wheels (.whl/) on the path, Triton's cache
# restored from a carried archive (.cache/triton.tgz) so kernels and autotuning results are reused.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export TRITON_CACHE_DIR=/tmp/triton_cache
mkdir -p $TRITON_CACHE_DIR
if [ -f .cache/triton.tgz ]; then tar -xzf .cache/triton.tgz -C $TRITON_CACHE_DIR; fi
# Archives over 15 MB are split (the device tool returns files up to 16 MB); gzip -1 (xz took minutes).
save_triton_cache() { tar -cf - -C $TRITON_CACHE_DIR . | gzip -1 | split -b 15m - "$OUT/triton.tgz." ; }
restore_triton_cache() {
  if ls .cache/triton.txz.* >/dev/null 2>&1; then cat .cache/triton.txz.* | tar -xJf - -C $TRITON_CACHE_DIR; fi
  if ls .cache/triton.tgz.* >/dev/null 2>&1; then cat .cache/triton.tgz.* | tar -xzf - -C $TRITON_CACHE_DIR; fi
}
# Test-only pure-Python packages (pytest, hypothesis) carried in .pylib/ where the machine lacks them.
if [ -d .pylib ]; then export PYTHONPATH=$PYTHONPATH:$PWD/.pylib; fi
restore_triton_cache
