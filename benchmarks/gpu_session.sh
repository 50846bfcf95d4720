#!/bin/bash
# One call on a lent GPU machine (one GPU, 16 CPU cores, no package registry): what
# the eleventh session ran, in one script, so that the next session with a GPU spends
# its minutes measuring. Results go to $OUT (or ./out/gpu-session).
#
# Before the call, on the development machine (the device has torch but not ortools):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl ortools==9.15.6755 immutabledict==4.3.1 \
#     protobuf==6.33.6 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
#     referencing==0.37.0 rpds-py==2026.9.1
# then run `bash benchmarks/gpu_session.sh` there, carrying .whl.
#
# The GPU checks run on cores 0-3; four one-thread gloo ranks time the schedules on
# cores 4-15 meanwhile (they see no GPU). Each part has its own time limit, together
# under the device's 10 minutes a call (GPU_LIMIT + ZOO_LIMIT, about 9 minutes).
set -u
OUT=${OUT:-out/gpu-session}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
python3 -c "import torch, ortools, crosscut; print(torch.__version__, torch.cuda.get_device_name(0))" \
  || exit 1
(
  export CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1
  timeout "${CPU_LIMIT:-280}" taskset -c 4-15 python3 benchmarks/schedules.py --measure --ranks 4 \
    --model resnet18 --batch 16 --size 64 --microbatches 4 --cost profiled --rounds 3 \
    > "$OUT/schedules-4ranks.txt" 2>&1
) &
cpu=$!
timeout "${GPU_LIMIT:-300}" taskset -c 0-3 python3 benchmarks/gpu_check.py --out "$OUT/gpu" \
  > "$OUT/gpu_check.txt" 2>&1
echo "gpu_check exit $?"
# then per-op data for a fit made without a GPU: six families, fp16 and TF32, both layouts
timeout "${ZOO_LIMIT:-240}" taskset -c 0-3 python3 benchmarks/gpu_check.py --out "$OUT/zoo" \
  --parts throughput,profile --throughput zoo --profiles zoo > "$OUT/gpu_check_zoo.txt" 2>&1
echo "gpu_check (zoo) exit $?"
rm -rf "$OUT/zoo/profiles"  # the per-node times are in zoo/gpu_check.json
# the cost caches are many small files: one archive comes back whole
if [ -d "$OUT/gpu/profiles" ]; then
  tar czf "$OUT/profiles.tgz" -C "$OUT/gpu" profiles && rm -rf "$OUT/gpu/profiles"
fi
wait $cpu
grep -v "^\s*File\|^\s*\^" "$OUT/gpu_check.txt" | tail -40
tail -25 "$OUT/gpu_check_zoo.txt"
tail -14 "$OUT/schedules-4ranks.txt"
