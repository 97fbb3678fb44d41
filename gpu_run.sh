python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,memory.used --format=csv > $OUT/smi.txt
cp benchmarks/results/h100.json $OUT/h100.json
timeout 420 python3 benchmarks/gpu_suite.py --parts tests,engine,serve --out $OUT/h100.json > $OUT/suite.txt 2>&1; echo "suite rc=$?" >> $OUT/rc.txt
cat > /tmp/defaults.py <<'PY'
import logging, time, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
t = time.monotonic()
from engine import LLM, SamplingParams
llm = LLM(model="synthetic:llama3-8b")
c = llm.engine.cfg
print("start-up s", round(time.monotonic() - t, 1))
print({k: getattr(c, k) for k in ("device", "dtype", "max_num_seqs", "max_num_batched_tokens", "max_loras", "lora_pool_rows", "max_lora_rank", "num_pages", "max_model_len")})
import torch; print("allocated GiB", torch.cuda.memory_allocated() / 2**30, "reserved", torch.cuda.memory_reserved() / 2**30, "free/total", [x / 2**30 for x in torch.cuda.mem_get_info()])
PY
timeout 150 python3 /tmp/defaults.py > $OUT/defaults.txt 2>&1; echo "defaults rc=$?" >> $OUT/rc.txt
