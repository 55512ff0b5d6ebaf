"""Running an artifact for users: one generation for `specpack run` (generate.py) and the
OpenAI-compatible server for `specpack serve` (serve.py, guards.py; the wire format is
schemas/openai.py) over the worker that feeds the engine (worker.py)."""
