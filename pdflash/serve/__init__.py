"""``pdflash serve``: an OpenAI-compatible HTTP server over the engine.

:func:`~pdflash.serve.build.build_engine` loads a checkpoint (and a DFlash
draft) into an engine; :class:`~pdflash.serve.loop.EngineLoop` runs it on its
own thread; :func:`~pdflash.serve.app.make_app` is the aiohttp application
(``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/metrics``).
"""

from __future__ import annotations

from pdflash.serve.build import EngineBundle, ServeModelConfig, build_engine, write_synthetic_model
from pdflash.serve.loop import EngineLoop, Finish, GenerationRequest, QueueFullError
from pdflash.serve.metrics import ServeMetrics

__all__ = [
    "EngineBundle",
    "EngineLoop",
    "Finish",
    "GenerationRequest",
    "QueueFullError",
    "ServeMetrics",
    "ServeModelConfig",
    "build_engine",
    "write_synthetic_model",
]
