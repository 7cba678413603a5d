"""The generation engines behind `services.models.engine`'s interface: transformers (`hf_engine`)
and vLLM (`vllm_engine`, `vllm_adapter`), any of them in a child process (`boot`, `child`,
`proc`, `serve`), M replicas as one (`replicas`), the pause/abort bookkeeping they share (`gate`)
and the one way to build one (`factory`, `backends`).

May import: services.core, services.rl, services.models.engine, services.models.errors,
services.models.io, services.models.weights, services.models.nets
"""
