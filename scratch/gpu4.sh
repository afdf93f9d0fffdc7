mkdir -p /tmp/res
cd "$(dirname "$0")/.."
pip install -q -e . --no-deps --no-build-isolation > /tmp/res/pip.log 2>&1
export PYTHONPATH=$PWD
git log --oneline -1 > /tmp/res/head.txt 2>&1
python -m storm_compile.cli calibrate > /tmp/res/calibrate.txt 2>&1
echo CAL >> /tmp/res/stage
python -m benchmarks.compile_time --models llama-3b-streamed --out /tmp/res/ct > /tmp/res/ct.log 2>&1
echo CT >> /tmp/res/stage
TORCHINDUCTOR_CACHE_DIR=/tmp/ind-tests python -m pytest -q -m gpu tests/ -p no:cacheprovider > /tmp/res/gputests.log 2>&1
echo DONE >> /tmp/res/stage
