"""Entry point: `python -m rollout_engine --backend vllm|jax ...` (see rollout_engine.cli)."""

import sys

from rollout_engine.cli import main

sys.exit(main())
