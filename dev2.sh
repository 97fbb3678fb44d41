set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
free -g | head -2; df -h /tmp | tail -1
rm -f /tmp/tmp*.log
timeout 540 python3 benchmarks/lora_zipf_http.py --model synthetic:llama3-1b --adapters 1000 --tenants 10 --clients 128 --requests 512 --rounds 2 --scale 1 --flags "--log-level info" --out $OUT/lora_zipf1000_h200.md > $OUT/zipf.log 2>&1; echo "zipf rc=$?"
tail -25 $OUT/zipf.log
for f in /tmp/tmp*.log; do grep -v "POST /v1/adapters\|GET /\|POST /v1/chat" $f | tail -60 > $OUT/server_$(basename $f); done
grep -h "memory:\|auto settings" /tmp/tmp*.log | cut -c1-600
nvidia-smi --query-gpu=clocks.sm --format=csv,noheader; df -h /tmp | tail -1
