# Sourced by each lab/*_session.sh device call: the wheels the H200 lacks (.whl/: transformers, peft) on
# PYTHONPATH, unbuffered output, and the GPU's clocks on record.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
