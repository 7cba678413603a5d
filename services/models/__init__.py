"""Model and tokenizer loading, tiny task models, the value head, reward models and generation engines.

Modules: `tokenizer` (task tokenizers), `tiny` (build + warm up a tiny model), `loading` (resolve and
load local model directories), `logprobs` (per-token response log-probs), `critic` (ValueModel),
`reward_model` (sequence-classifier rewards), `engine` (the generation-engine interface and factory)
and `hf_engine` (the transformers backend).
"""
