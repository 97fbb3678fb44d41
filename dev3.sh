set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
for f in "--log-level=warning" "--no-prefix-cache"; do
  n=$(echo $f | tr -dc a-z)
  timeout 200 python3 benchmarks/lora_zipf_http.py --model synthetic:llama3-1b --adapters 16 --tenants 8 --clients 128 --requests 512 --rounds 2 --scale 1 --flags="$f" --out $OUT/z16_$n.md > $OUT/z16_$n.log 2>&1; echo "$f rc=$?"
  grep "^lora\|^base\|^errors\|vs_base\|connections_open" $OUT/z16_$n.log | cut -c1-330
done
nvidia-smi --query-gpu=clocks.sm --format=csv,noheader
