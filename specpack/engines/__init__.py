"""External serving engines (vLLM, SGLang, TensorRT-LLM) started on a verified artifact.

The package hands on the names of launch.py."""

from __future__ import annotations

from specpack.engines.launch import (
    ENGINES, Engine, EngineLaunch, MissingEngineError, find, prepare, recheck, run, KEY_ENV)

__all__ = ["ENGINES", "Engine", "EngineLaunch", "MissingEngineError", "find", "prepare", "recheck", "run",
           "KEY_ENV"]
