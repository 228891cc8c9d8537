#!/usr/bin/env bash
# The GPU suite (tests/gpu) on a CUDA machine, one pytest process per test file, all at once:
# the files share the GPUs (a parity case spawns one rank per GPU, a kernel case uses one),
# so the suite takes about as long as its slowest file (tests/gpu/test_gpu_kernels.py, whose
# Triton compilations dominate) instead of the sum of all files.
#
#   bash scripts/gpu_tests.sh                    # logs and JUnit files under out/gpu_tests
#   OUT=/some/dir bash scripts/gpu_tests.sh -k parity
#
# Extra arguments go to every pytest process. Each file writes FILE.log and FILE.xml into
# $OUT; the summary (passed, failed, skipped per file, and the failures' names) is printed
# last. Exits 1 if any case failed or errored, or if a file collected nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu_tests}"
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast stays off (NCCL's NVLS and torch's symmetric memory).
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_tests.sh: no CUDA device here; the GPU suite needs one" >&2
    exit 1
fi
mkdir -p "$OUT"
files=(tests/gpu/test_*.py)
start=$SECONDS
for file in "${files[@]}"; do
    name="$(basename "$file" .py)"
    "$PYTHON" -m pytest "$file" -m gpu -q -p no:cacheprovider --durations=5 \
        --junitxml="$OUT/$name.xml" "$@" >"$OUT/$name.log" 2>&1 &
done
wait
echo "GPU suite: ${#files[@]} files in $((SECONDS - start)) s"
"$PYTHON" - "$OUT" "${files[@]}" <<'EOF'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, files = Path(sys.argv[1]), sys.argv[2:]
bad = False
for file in files:
    name = Path(file).stem
    xml = out / f"{name}.xml"
    if not xml.exists():
        print(f"{name}: no result (see {out / (name + '.log')})")
        bad = True
        continue
    suite = ET.parse(xml).getroot().find("testsuite")
    total, failed = int(suite.get("tests")), int(suite.get("failures")) + int(suite.get("errors"))
    skipped = int(suite.get("skipped"))
    print(f"{name}: {total - failed - skipped} passed, {failed} failed, {skipped} skipped")
    for case in suite.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            print(f"  FAILED {case.get('name')}")
    bad |= failed > 0 or total == 0
sys.exit(1 if bad else 0)
EOF
