"""Models of a run and the generation engines. The root modules are the contract every
sub-package shares: `engine` (the generation-engine interface, its sampling parameters and errors)
and `errors`. Sub-packages depend downward only, in this order: `io` (local model directories:
loading, atomic writes, durable steps, GGUF, a light text decoder), `weights` (strict weight
sync, its checksums and its transfer to an engine process), `nets` (per-token log-probs, the value
model, LoRA), `engines` (the transformers and vLLM backends, engines in a child process, replicas,
the factory), `roles` (the models of a run's roles, tiny models and their tokenizers) and
`checkpoints` (crash-safe checkpoints and export).

May import: services.core, services.rl
"""
