set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
echo "nofile $(ulimit -n) $(ulimit -Hn) somaxconn $(cat /proc/sys/net/core/somaxconn)"
rm -f /tmp/tmp*.log
timeout 250 python3 benchmarks/lora_zipf_http.py --model synthetic:llama3-1b --adapters 16 --tenants 8 --clients 128 --requests 512 --rounds 2 --scale 1 --flags="--log-level=info" --out $OUT/z16.md > $OUT/z16.log 2>&1; echo "rc=$?"
grep -v "^    \|^  File\|^\s*\^" $OUT/z16.log | tail -22
for g in /tmp/tmp*.log; do cp $g $OUT/server_$(basename $g); done
