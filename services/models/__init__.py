"""Models of a run and the generation engines. Dependencies point down this list, never up:

- `roles` (the models of a run's roles, prepared once) -> `paths` (resolve a role's model directory,
  building a tiny one) -> `tiny`, `reward_model` (tiny-model builders) -> `loading` (load local model
  directories), `tokenizer`, `atomic` (publish a built directory atomically).
- `factory.make_engine` (in process, in a child process, or M replicas) -> `replicas` (`ReplicaEngine`:
  M engines as one) -> `engine_proc` (`ProcessEngine`) ->
  `backends` (the in-process backends by name) -> `hf_engine`, `vllm_engine` (+ `vllm_adapter`) ->
  `gate` (pause/abort/in-flight), `weights` (strict weight sync) -> `engine` (the interface).
- `checkpoint` (crash-safe save/load/prune) -> `checkpoint_optim`, `checkpoint_layout` -> `durable`.
- `critic` (ValueModel), `logprobs` (per-token response log-probs).
"""
