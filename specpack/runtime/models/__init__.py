"""Our decoders: the dense Llama family (dense.py) and DeepSeek-V3 (deepseek.py), their configs
(config.py) and weights (weights.py), and the rows of a batched forward (rows.py)."""
