#!/usr/bin/env bash
# The one-GPU check (issue "Speed at the limits", item 7), for a one-GPU machine with JAX (CUDA),
# torch, flax, optax, orbax, grpcio and transformers installed and nothing else to install:
# the train step's tokens/s and MFU, the JAX engine's decode tokens/s against its HBM roofline,
# and a 1 GB bf16 push from a JAX process to a torch process on the same GPU by CUDA IPC and by
# jax_transfer against a device-to-device copy (benchmarks/gpu_check.py says how each is
# counted). Each part runs under its own time limit (PART_TIMEOUT_S, default 150 s: the three
# fit in 8 minutes); a part that fails or runs out prints why and the others still run. The last
# line is one JSON object with every part's figures. Usage, from the repository root:
#   bash benchmarks/gpu_check.sh [--small]      (--small: tiny sizes, runs on a CPU too)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LIMIT=${PART_TIMEOUT_S:-150}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX and torch share the one GPU
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
"$PY" -c 'import jax; print("jax", jax.__version__, jax.devices())'
out=$(mktemp -d)
status=0
for part in train decode push; do
  echo "== $part"
  if timeout "$LIMIT" "$PY" benchmarks/gpu_check.py "$part" "$@" | tee "$out/$part.log"; then
    tail -n 1 "$out/$part.log" > "$out/$part.json"
  else
    status=1
    echo "{\"part\": \"$part\", \"failed\": \"exit ${PIPESTATUS[0]} (124: over ${LIMIT} s)\"}" \
      > "$out/$part.json"
  fi
done
"$PY" - "$out" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(json.dumps({p: json.loads((out / f"{p}.json").read_text()) for p in ("train", "decode", "push")}))
PYEOF
exit $status
