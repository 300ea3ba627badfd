#!/usr/bin/env bash
# Build .gpu_wheels/: the wheels the GPU machine lacks, for its Python 3.12, within the 64 MiB a device
# run may carry. flashinfer-python 0.7.2's wheel alone is ~62 MiB, so it is trimmed: data files of
# kernels radixrt never JIT-compiles (MoE, GEMM, experimental, communication) are dropped; its Python
# modules all stay, so `import flashinfer` is unchanged. Run here (the package registry is reachable),
# then carry `.gpu_wheels` with the device run.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu_wheels && mkdir -p .gpu_wheels
PLAT=(--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 --implementation cp --no-deps)
python -m pip download -q -d .gpu_wheels "${PLAT[@]}" msgspec pyzmq xgrammar gguf apache-tvm-ffi
python -m pip download -q -d .gpu_wheels/full --no-deps flashinfer-python==0.7.2
python - <<'PY'
import re
import zipfile
from pathlib import Path
src = next(Path(".gpu_wheels/full").glob("flashinfer_python-*.whl"))
# Kernel sources of features radixrt never JIT-compiles; the attention kernels (batch prefill/decode, FA2 and
# FA3 on Hopper, with the cutlass/cccl headers they include) stay.
drop = re.compile(r"/(cake_|kda|gdn|blackwell|alphamoe|fused_moe|moe_ep|experimental/|gemm/|comm/|nv_internal|"
                  r"trtllm|deepgemm|cutlass/(examples|test|docs|tools|python)/)")
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(Path(".gpu_wheels") / src.name, "w", zipfile.ZIP_DEFLATED) as zout:
    for item in zin.infolist():
        name = item.filename
        if not name.endswith(".py") and "dist-info" not in name and drop.search(name):
            continue
        zout.writestr(item, zin.read(item))
PY
rm -rf .gpu_wheels/full
du -sh .gpu_wheels && ls -la .gpu_wheels
