"""batchgen: offline batch generation for LLMs."""

import time

# When this process began importing batchgen (the first thing `batchgen run` does): run reports count the
# start-up (imports of torch and transformers) from here. A constant, set once.
IMPORT_STARTED_MONOTONIC = time.monotonic()

from batchgen.sampling_params import ResponseFormat, SamplingParams  # noqa: E402

__version__ = "0.1.0"


def __getattr__(name: str):
    # The engine imports torch and transformers: load it only when asked for, so the CLI starts fast.
    if name in ("Engine", "EngineConfig", "PromptResult", "Sample"):
        from batchgen.engine import engine

        return getattr(engine, name)
    raise AttributeError(name)


__all__ = ["Engine", "EngineConfig", "PromptResult", "ResponseFormat", "Sample", "SamplingParams", "__version__"]
