set -x
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
mkdir -p $OUT
cp benchmarks/results/h100.json $OUT/h100.json
timeout 560 python3 benchmarks/gpu_suite.py --parts tests,serve --out $OUT/h100.json > $OUT/suite.log 2>&1
echo rc=$?
tail -n 40 $OUT/suite.log
nvidia-smi --query-gpu=name,clocks.sm --format=csv
