set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
cd benchmarks
timeout 200 python3 spec_profile.py --out $OUT > $OUT/spec_profile.log 2>&1; echo "spec rc=$?"
tail -8 $OUT/spec_profile.log
timeout 150 python3 decode_gemm_tune.py --out $OUT/dg80.json --rows 80 > $OUT/dg80.log 2>&1; echo "dg rc=$?"
tail -5 $OUT/dg80.log
cd ..
timeout 180 python3 -m pytest -q -x -m gpu tests/test_lora_pool.py tests/test_gpu_engine.py tests/test_sampler_gpu.py tests/test_grammar_hardening.py -p no:cacheprovider > $OUT/pytest.log 2>&1; echo "pytest rc=$?"
tail -5 $OUT/pytest.log
nvidia-smi --query-gpu=clocks.sm,temperature.gpu --format=csv
