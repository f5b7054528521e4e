"""Environments of multi-turn rollouts: between two model turns an environment reads the
model's turn and answers with an observation (a tool's output, a game's feedback). Pure Python
(reasoning-gym imported lazily), so the engine worker and the trainer can both load them; see
`envs.base` for the seam and `envs.registry` for the factory."""
