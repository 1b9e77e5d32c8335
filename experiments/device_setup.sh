# Sourced by an experiment's device script from the checkout's root (`. experiments/device_setup.sh NAME`): unbuffered
# Python, the checkout first on PYTHONPATH and installed without dependencies (the device has no package index),
# $OUT/NAME made, the GPU's name printed.
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
mkdir -p "$OUT/$1"
nvidia-smi --query-gpu=name --format=csv,noheader
