"""`python -m trainer eval`: sampling metrics (pass@k, maj@k), any JSONL as problems, and the
command that starts the engines the way the main job does and scores their completions."""
