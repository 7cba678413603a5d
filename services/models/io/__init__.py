"""Local model directories: loading models and tokenizers (never a hub id), writing a directory
atomically, durable file-system steps, GGUF files dequantized once, and a text decoder on the
`tokenizers` library alone.

May import: services.core, services.models.errors
"""
