"""The models package's error, importable without torch (the launcher checks paths before any import)."""


class ModelLoadError(RuntimeError):
    """A model or tokenizer that cannot be found, built or loaded; the message names the path."""
